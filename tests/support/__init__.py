"""Helpers the tests share: synthetic and damaged data, fault proxies, the GCS emulator, loopback
clusters, group ranks and the one checkpoint round-trip helper (:mod:`tests.support.roundtrip`)."""
