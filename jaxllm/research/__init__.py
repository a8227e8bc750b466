"""Research tools for notebooks: sampling comparisons, checkable tasks, frontier plots,
sequence state in hand and model inspection. Needs the `research` extra (pandas, matplotlib),
imported only when a function that needs it runs."""

from jaxllm.research.compare import compare, summary
from jaxllm.research.frontier import frontier, pareto_front
from jaxllm.research.inspection import Trace, logit_lens, logit_lens_table, plot_attention, trace
from jaxllm.research.tasks import Task, make_tasks

__all__ = [
    "compare",
    "summary",
    "frontier",
    "pareto_front",
    "Task",
    "make_tasks",
    "Trace",
    "trace",
    "logit_lens",
    "logit_lens_table",
    "plot_attention",
]
