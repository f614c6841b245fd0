"""Everything a request handler needs, built once at start-up by ``server.main``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker

from server.engine_client.adapters import AdapterLoads
from server.engine_client.pool import EnginePool
from server.metrics import Metrics
from server.proxy.session_cache import SessionRegistry
from server.rl.admission import Admission
from server.settings import ServerSettings
from server.store.byte_lru import MB, ByteLRU
from server.store.database import StoreHealth
from server.store.run_adapters import RunAdapters
from server.store.run_config import RunConfigs
from server.store.writer import TurnWriter
from server.text.tokenization import Tokenizer


@dataclass(eq=False)
class ServerContext:
    settings: ServerSettings
    admin_key_hash: str
    dashboard_secret: bytes  # signs login cookies; kept in the store (store/secrets.py)
    database: AsyncEngine
    sessionmaker: async_sessionmaker
    writer: TurnWriter
    pool: EnginePool
    tokenizer: Tokenizer
    sessions: SessionRegistry
    run_configs: RunConfigs
    run_adapters: RunAdapters  # which adapter serves each LoRA run now
    admission: Admission = field(default_factory=Admission)
    metrics: Metrics = field(default_factory=Metrics)
    default_run_id: str = ""
    store_health: StoreHealth = field(default_factory=StoreHealth)
    # key hash -> (kind, run id, session id); the hashes no key of the store has. Bounded in
    # bytes (--lookup-cache-mb): what is dropped is looked up again.
    key_cache: ByteLRU[str, tuple[str, str | None, str | None]] = field(
        default_factory=lambda: ByteLRU(24 * MB)
    )
    unknown_keys: ByteLRU[str, bool] = field(default_factory=lambda: ByteLRU(8 * MB))
    started_at: float = field(default_factory=time.time)
    model_name: str = ""  # the served model's name, fixed at start
    # This process among the replicas sharing the store (server.store.leadership).
    replica_id: str = ""
    adapter_loads: AdapterLoads = field(default_factory=AdapterLoads)  # what each engine holds

    @property
    def context_length(self) -> int | None:
        return self.pool.context_length
