"""``kvbridge bench ...``: one module per sub-command, each with ``add_arguments(parser)``
and ``run(args) -> dict`` (the JSON written under bench/results/), plus ``plot(result,
png_path)`` and ``summary(result) -> str``. See BENCHMARKS.md."""

from __future__ import annotations

# sub-command name -> module under kvbridge.tools.bench
BENCHMARKS: dict[str, str] = {
    "handshake": "kvbridge.tools.bench.handshake",
    "sidechannel": "kvbridge.tools.bench.sidechannel",
    "transfer": "kvbridge.tools.bench.transfer",
    "serve": "kvbridge.tools.bench.serve",
    "fleet": "kvbridge.tools.bench.fleet",
    "hostile": "kvbridge.tools.bench.hostile",
    "vllm": "kvbridge.tools.bench.vllm",
    "clients": "kvbridge.tools.bench.clients",
}
