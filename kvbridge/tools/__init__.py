"""Tools, not the product: what tests, benchmarks and demos use. No module outside this
package imports it (tests/test_layout.py checks); the CLI offers ``kvbridge bench`` and
``kvbridge demo`` from here.

Modules and sub-packages (each imports only the ones above it in this list):

* ``testing/``   fixtures: a throw-away etcd, certificates, ``wait_until``, Prometheus
                 text, ``/proc`` readings, an app in a thread
* ``launch``     ``kvbridge`` sub-commands as child processes (start, wait healthy, read a
                 metric, stop)
* ``vllm/``      real vLLM servers started for tests, benches and the demo; the drift guard
                 and the fingerprints of every release in the plug-in's window
* ``demo``       ``kvbridge demo``: prefill + decode + proxy on a real model
* ``bench/``     ``kvbridge bench ...``: one module per benchmark
"""
