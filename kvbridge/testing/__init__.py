"""What tests, benchmarks and the demo start, never a production server: a throw-away etcd
(``kvbridge.testing.etcd``)."""
