"""What the routes share, on `app.ctx.server`: settings, the model and its worker, the
session store, metrics, and the server's own flags (draining, requests in flight)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from serving.metrics import Metrics
from serving.scheduler import Scheduler, warmup_engine
from serving.sessions import SessionStore
from serving.settings import SettingsStore

log = logging.getLogger("jaxllm.serve")


class Server:
    """What the routes share (on `app.ctx.server`): model, scheduler, stores, settings."""

    def __init__(
        self,
        settings: SettingsStore,
        loader: Callable[[], Any],
        model_name: str,
        api_keys: frozenset[str],
        warmup: bool,
        on_death: Callable[[BaseException], None] | None,
        profile_dir: str | None = None,
    ):
        self.settings = settings
        self.profile_dir = profile_dir
        self.profiling = False
        self.profile_timer: asyncio.TimerHandle | None = None  # stops a trace at profile_max_seconds
        self.costs: dict[str, int] | None = None  # jaxllm.costs.ModelCosts of the loaded model
        self.loader = loader
        self.model_name = model_name
        self.api_keys = api_keys  # empty: no authentication
        self.warmup = warmup
        self.on_death = on_death
        self.metrics = Metrics()
        self.warmup_done = self.warmup_total = 0  # shape variants compiled so far, of all
        lim = settings.current.limits
        self.sessions = SessionStore.open(lim.session_ttl_seconds, lim.session_dir)  # read back a saved store
        self.model: Any = None
        self.engine: Any = None
        self.scheduler: Scheduler | None = None
        self.load_error: BaseException | None = None
        self.draining = False  # stopping: in-flight requests finish, new ones get 503
        self.in_flight = 0  # generation requests whose response is not fully sent
        self._ids = itertools.count()

    @property
    def ready(self) -> bool:
        return self.scheduler is not None and self.scheduler.ready and self.scheduler.dead is None

    def load(self, loop: asyncio.AbstractEventLoop) -> None:
        """Loads the model and starts the worker (which warms up); runs on its own thread."""
        from jaxllm.costs import model_costs
        from jaxllm.state import kv_bytes_per_page, recurrent_bytes_per_sequence

        try:
            started = time.perf_counter()
            self.model = self.loader()
            self.settings.use_model_defaults(self.model.generation_defaults)
            log.info(
                "sampling defaults: %s (settings [defaults], else the model's generation config, else OpenAI's)",
                self.settings.current.sampling_defaults,
            )
            self.costs = dataclasses.asdict(model_costs(self.model.cfg, self.model.params, self.model.options))
            e = self.settings.current.engine
            cfg, opts = self.model.cfg, self.model.options
            per_position = kv_bytes_per_page(cfg, 1, opts)
            self.engine = self.model.engine(e.engine_config(per_position, recurrent=bool(cfg.n_linear_layers)))
            engine = self.engine

            def warm() -> None:
                t = time.perf_counter()
                rounds = (
                    warmup_engine(engine, vocab=cfg.vocab_size, progress=self.warmup_progress) if self.warmup else 0
                )
                log.info(
                    "warm-up: %d rounds in %.1fs (model loaded in %.1fs)", rounds, time.perf_counter() - t, t - started
                )

            self.scheduler = Scheduler(
                engine,
                self.model.tokenizer,
                self.settings,
                self.metrics,
                self.sessions,
                bytes_per_page=int(kv_bytes_per_page(cfg, engine.layout.page_size, opts)),
                vocab=cfg.vocab_size,
                recurrent_bytes=recurrent_bytes_per_sequence(cfg),
                cache_options=f"{self.model_name}:{opts.dtype}:{opts.kv_dtype}".encode(),
                on_death=self.on_death,
                warmup=warm,
            )
            self.scheduler.start()
        except BaseException as e:  # noqa: BLE001
            self.load_error = e
            log.critical("model load failed: %s", e, exc_info=True)
            if self.on_death is not None:
                self.on_death(e)

    def warmup_progress(self, done: int, total: int) -> None:
        """Warm-up's count of compiled variants: /health shows it; the log gets every tenth."""
        last = self.warmup_done
        self.warmup_done, self.warmup_total = done, total
        if done in (0, total) or done * 10 // total != last * 10 // total:
            log.info("warm-up %d/%d shape variants compiled", done, total)

    def key_of(self, authorization: str) -> str | None:
        """The API key an Authorization header carries, if it is one of ours (constant time)."""
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not given:
            return None
        found = None
        for k in self.api_keys:  # every key is compared, so the time says nothing about which matched
            if secrets.compare_digest(given.encode(), k.encode()):
                found = k
        return found

    def next_id(self, kind: str) -> str:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return f"{prefix}-{secrets.token_hex(12)}"
