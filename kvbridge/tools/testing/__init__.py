"""What tests, benchmarks and the demo use, never a production server: a throw-away etcd
(``etcd_server``), certificates (``certs``), the one polling helper (``wait``), the reader of
Prometheus text (``prometheus``), ``/proc`` readings (``procfs``) and an app served in a
thread (``api_server``)."""
