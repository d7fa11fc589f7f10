"""Read `/metrics` text back with prometheus_client's own parser (what a scraper sees)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


@dataclass(frozen=True)
class Scrape:
    """The parsed exposition: families by name (counters without `_total`)."""

    families: dict[str, list[Sample]]
    types: dict[str, str]

    @classmethod
    def parse(cls, text: str) -> Scrape:
        """Raises ValueError if `text` is not valid Prometheus text."""
        families = list(text_string_to_metric_families(text))
        return cls({f.name: f.samples for f in families}, {f.name: f.type for f in families})

    def value(self, sample: str, **labels: str) -> float:
        """The value of the sample named `sample` with exactly `labels`. Raises KeyError."""
        for samples in self.families.values():
            for s in samples:
                if s.name == sample and s.labels == labels:
                    return s.value
        raise KeyError(f"no sample {sample}{labels}")

    def labels(self, sample: str) -> list[dict[str, str]]:
        """The label sets of every sample named `sample`."""
        return [s.labels for ss in self.families.values() for s in ss if s.name == sample]
