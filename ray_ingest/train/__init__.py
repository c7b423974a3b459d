"""The training job: ``job`` (the TorchTrainer driver and ``train_loop_per_worker``), ``detect``
(the rank's topology from Ray Train or the environment), ``quiet`` (one-screen output of an
embedded Ray), ``ledger`` (the consumption ledger the audit reads)."""
