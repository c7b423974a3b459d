"""`ray-ingest` command line: one thin module per subcommand, each wrapping a library call."""
