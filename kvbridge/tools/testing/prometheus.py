"""The one reader of Prometheus text for tests, benchmarks and the demo.

``parse_samples`` turns a ``/metrics`` page into ``{sample: value}`` (the sample written as
on the page, labels included: ``name{a="b"}``); ``metric_total`` sums one metric over its
label sets (or picks one, named with its labels).
"""

from __future__ import annotations

from typing import Any

__all__ = ["labelled_total", "metric_total", "parse_samples", "read_samples"]


def parse_samples(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text page; comments and blank lines skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if not key or line.startswith("#"):
            continue
        try:
            out[key] = float(value)
        except ValueError:  # not a sample line
            continue
    return out


def metric_total(samples: dict[str, float], name: str) -> float:
    """Sum of every sample of ``name`` (all label sets; or one, written ``name{...}``)."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def labelled_total(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include every one of ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in samples.items() if k.startswith(name + "{")
               and all(w in k[len(name) + 1:-1].split(",") for w in want))


def read_samples(client: Any, url: str, timeout: float = 10) -> dict[str, float]:
    """``parse_samples`` of ``url + "/metrics"``, fetched with an httpx ``client``."""
    r = client.get(url + "/metrics", timeout=timeout)
    r.raise_for_status()
    return parse_samples(r.text)
