"""What tests, benchmarks and the demo use, never a production server: a throw-away etcd
(``etcd``), certificates (``certs``), the one polling helper (``wait``), the reader of
Prometheus text (``prometheus``) and ``/proc`` readings (``procfs``)."""
