"""GCS emulator and fault-injecting proxy fixtures (filled in by the remote-data work)."""
