"""A small CPU reference engine in the style of nano-vllm.

``LLMEngine`` (engine.py) drives a ``Scheduler`` (scheduler.py: continuous
batching over a ``BlockManager``'s paged KV blocks) and a ``WorkerGroup``
(workers.py: one ``ModelRunner`` per TP rank). ``AsyncEngine`` runs it in a
background thread for the API server. An instance across nodes: ``distributed``
(the process group and the calls rank 0 relays) and ``remote_node`` (``run_node``:
the ranks of a non-head node).
"""

from kvbridge.engine.async_engine import AsyncEngine, EngineDeadError
from kvbridge.engine.block_manager import BlockManager
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.engine import LLMEngine, build_engine
from kvbridge.engine.model_runner import ModelRunner, StepInput, WorkerConnectorFactory
from kvbridge.engine.sampling import SamplingParams
from kvbridge.engine.scheduler import Scheduler
from kvbridge.engine.sequence import RequestOutput, RequestStatus, Sequence
from kvbridge.engine.workers import WorkerDiedError, WorkerError, WorkerGroup

__all__ = [
    "AsyncEngine", "BlockManager", "EngineConfig", "EngineDeadError", "LLMEngine", "ModelRunner",
    "RequestOutput", "RequestStatus", "SamplingParams", "Scheduler", "Sequence", "StepInput",
    "WorkerConnectorFactory", "WorkerDiedError", "WorkerError", "WorkerGroup", "build_engine",
]
