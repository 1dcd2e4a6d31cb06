"""vLLM's Prometheus counters, read from the text of its `/metrics` endpoint."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def counter_totals(text: str, names: list[str]) -> dict[str, float]:
    """Each named sample summed over its label sets (vLLM labels a counter per engine and model);
    0.0 for a name the text lacks."""
    totals = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals
