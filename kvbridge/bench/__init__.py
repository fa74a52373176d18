"""``kvbridge bench ...``: one module per sub-command, each with ``add_arguments(parser)``
and ``run(args) -> dict`` (the JSON written under bench/results/), plus ``plot(result,
png_path)`` and ``summary(result) -> str``. See BENCHMARKS.md."""

from __future__ import annotations

# sub-command name -> module under kvbridge.bench
BENCHMARKS: dict[str, str] = {
    "handshake": "kvbridge.bench.handshake",
    "sidechannel": "kvbridge.bench.sidechannel",
    "transfer": "kvbridge.bench.transfer",
    "serve": "kvbridge.bench.serve",
    "fleet": "kvbridge.bench.fleet",
    "hostile": "kvbridge.bench.hostile",
    "vllm": "kvbridge.bench.vllm",
    "clients": "kvbridge.bench.clients",
}
