"""Declarative sharding (issue 19, docs/sharding.md): rules map the models' logical axes
(models/axes.py) to mesh axes; the collectives are derived (derive.py), shown (`shardlab explain`) and
compiled onto the model (compile.py) with shardlab.comm's differentiable collectives.

    rules = Rules.parse("heads=tp, kv_heads=tp, mlp=tp, vocab=tp")
    plan = derive(model, rules, {"dp": 1, "tp": 2}, rows=8)        # no process group needed
    model = compile_plan(model, plan, mesh.group("tp"))           # in place; model.placement written
"""

from shardlab.parallel.sharding.compile import compile_plan
from shardlab.parallel.sharding.derive import derive
from shardlab.parallel.sharding.plan import Collective, ModulePlan, ShardingPlan
from shardlab.parallel.sharding.rules import Rules, ShardingError
from shardlab.parallel.sharding.section import ShardingSection

__all__ = ["Collective", "ModulePlan", "Rules", "ShardingError", "ShardingPlan", "ShardingSection", "compile_plan", "derive"]
