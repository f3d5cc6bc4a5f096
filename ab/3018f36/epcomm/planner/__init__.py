"""epcomm.planner: predicted traffic, time, SM count and buffer memory of MoE dispatch/combine.

Pure Python (no torch), so it runs on a laptop before a cluster is booked::

    from epcomm.planner import Workload, plan, preset
    report = plan(preset("h800-cx7"), Workload(num_tokens=4096, hidden=7168, num_topk=8, num_experts=256))
    print(report.format_table())

Three strategies are compared: allgather + local permute, a flat all-to-all, and hierarchical
forwarding (cross the inter-domain tier once per destination domain, then forward inside it).
On request (``strategies=("per_expert", "flat")``), the low-latency layout too: a message per
(token, expert) pair, against ``flat``'s one per (token, rank).
The routing model and every formula are documented in :mod:`.expectations` and :mod:`.cost_model`.
"""

from .cost_model import (
    ALL_STRATEGIES,
    STRATEGIES,
    PhaseEstimate,
    PlanReport,
    StrategyEstimate,
    estimate,
    plan,
    slowest_rank_factor,
    suggest_sms,
)
from .expectations import (
    Expectations,
    expectations,
    prob_miss,
    prob_reach_all_of,
    prob_reach_with_replacement,
    with_measured,
)
from .topology import (
    Tier,
    Topology,
    link_gbps_from_logical,
    load_topology,
    preset,
    preset_names,
)
from .workload import Workload, bytes_per_token

__all__ = [
    "ALL_STRATEGIES",
    "STRATEGIES",
    "Expectations",
    "PhaseEstimate",
    "PlanReport",
    "StrategyEstimate",
    "Tier",
    "Topology",
    "Workload",
    "bytes_per_token",
    "estimate",
    "expectations",
    "link_gbps_from_logical",
    "load_topology",
    "plan",
    "preset",
    "preset_names",
    "prob_miss",
    "prob_reach_all_of",
    "prob_reach_with_replacement",
    "slowest_rank_factor",
    "suggest_sms",
    "with_measured",
]
