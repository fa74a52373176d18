"""``kvbridge bench``: its sub-parsers (each benchmark's module imported only when chosen)
and the runner that writes NAME.json and NAME.png."""

from __future__ import annotations

import argparse
import sys


class LazyBenchParser(argparse.ArgumentParser):
    """A benchmark's sub-parser: its module (and arguments) imported only when chosen."""

    def __init__(self, *args, module: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self._module, self._loaded = module, False

    def parse_known_args(self, args=None, namespace=None):
        if not self._loaded:
            import importlib

            self._loaded = True
            importlib.import_module(self._module).add_arguments(self)
        return super().parse_known_args(args, namespace)


def bench_parser(sub: argparse._SubParsersAction) -> None:
    from kvbridge.tools.bench import BENCHMARKS

    b = sub.add_parser("bench", help="benchmarks: JSON + PNG under --out (see BENCHMARKS.md)")
    bsub = b.add_subparsers(dest="benchmark", required=True, parser_class=LazyBenchParser)
    for name, module in BENCHMARKS.items():
        bp = bsub.add_parser(name, module=module, help=f"see {module}")
        bp.add_argument("--out", default="bench/results", help="directory for NAME.json/.png")
        bp.add_argument("--quick", action="store_true", help="tiny sizes (smoke tests)")
        bp.set_defaults(bench_module=module)


def run_bench(args: argparse.Namespace) -> int:
    import importlib
    from pathlib import Path

    from kvbridge.tools.bench import report

    mod = importlib.import_module(args.bench_module)
    result = mod.run(args)
    path = report.write(args.benchmark, result, Path(args.out))
    png = path.with_suffix(".png")
    print(mod.summary(result))
    try:
        mod.plot(result, png)
    except ImportError as e:
        if (e.name or "").partition(".")[0] != "matplotlib":
            raise
        # The measurement is kept; only the picture is missing.
        print(f"wrote {path}", flush=True)
        print(f"kvbridge bench {args.benchmark}: no plot: matplotlib is not installed "
              f"(pip install 'kvbridge[bench]'; make venv installs it); {path} was written",
              file=sys.stderr)
        return 2
    print(f"wrote {path} and {png}")
    return 0
