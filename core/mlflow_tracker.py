"""The ``mlflow`` tracker of :data:`featcache.core.tracking.TRACKERS` (``--track mlflow[:URI]``).

Imported only when ``--track mlflow`` is given; it imports ``mlflow`` on first use. Each
featcache run is one MLflow run in the experiment ``featcache`` (``$MLFLOW_EXPERIMENT_NAME``
overrides it), found again by its tag ``featcache.run_id``: a rerun logs into the same MLflow
run (new metric values, artifacts replaced; MLflow keeps a param's first value, so a param that
changed keeps it and ``config.json`` holds the latest config). A nested run carries MLflow's
``mlflow.parentRunId`` tag.

A dead server must fail fast: MLflow's client retries a request 7 times with exponential backoff
and waits 120 s for an answer by default, which it reads from ``MLFLOW_HTTP_REQUEST_MAX_RETRIES``
and ``MLFLOW_HTTP_REQUEST_TIMEOUT`` on every request (its client takes no such option). Each
call into MLflow here runs in :func:`fail_fast`, which sets those variables (a user's own values
win) for the length of the call only and restores the environment afterwards: one attempt, and
at most :data:`REQUEST_TIMEOUT` seconds waiting.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from featcache.core.tracking import RUN_ID_TAG, STAGE_TAG, TrackedRun

log = logging.getLogger(__name__)

__all__ = ["REQUEST_TIMEOUT", "MlflowTracker", "fail_fast"]

#: seconds one request to a tracking server may wait for its answer
REQUEST_TIMEOUT = 10
#: the variables :func:`fail_fast` sets while featcache calls MLflow (where the user set none)
_SCOPED_ENV = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": str(REQUEST_TIMEOUT),
    # read once, when mlflow is imported: its log records then go through the command's own
    # logging (-q, --log-file) rather than a handler mlflow adds to its logger
    "MLFLOW_CONFIGURE_LOGGING": "false",
}
_ENV_LOCK = threading.Lock()
#: MLflow's limits on one log_batch call
_BATCH_PARAMS = 100
_BATCH_METRICS = 1000
_PARENT_TAG = "mlflow.parentRunId"


@contextlib.contextmanager
def fail_fast() -> Iterator[None]:
    """MLflow's request retries and timeout set for one call (the user's own values kept), the
    environment restored afterwards."""
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in _SCOPED_ENV}
        for k, v in _SCOPED_ENV.items():
            os.environ.setdefault(k, v)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


class MlflowTracker:
    """Log :class:`~featcache.core.tracking.TrackedRun` records to the MLflow tracking ``uri``."""

    def __init__(self, uri: str, experiment: str | None = None) -> None:
        with fail_fast():
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        self.experiment = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "featcache"
        self._experiment_id: str | None = None

    def experiment_id(self) -> str:
        """The experiment's id, created on first use (another writer creating it first is fine)."""
        if self._experiment_id is None:
            found = self.client.get_experiment_by_name(self.experiment)
            if found is None:
                try:
                    self._experiment_id = self.client.create_experiment(self.experiment)
                except Exception:  # created meanwhile by another process
                    found = self.client.get_experiment_by_name(self.experiment)
                    if found is None:
                        raise
            if found is not None:
                self._experiment_id = found.experiment_id
        return str(self._experiment_id)

    def find(self, run_id: str) -> Any:
        """The MLflow run tagged with featcache ``run_id`` (the oldest, if several), or None."""
        runs = self.client.search_runs(
            [self.experiment_id()],
            filter_string=f"tags.`{RUN_ID_TAG}` = '{run_id}'",
            max_results=1,
            order_by=["attributes.start_time ASC"],
        )
        return runs[0] if runs else None

    def log_run(self, run: TrackedRun, parent: str | None = None) -> str:
        """Create or update the MLflow run of ``run.run_id``; its MLflow run id."""
        with fail_fast():
            return self._log(run, parent)

    def _log(self, run: TrackedRun, parent: str | None) -> str:
        from mlflow.entities import Metric, Param, RunTag

        tags = {RUN_ID_TAG: run.run_id, STAGE_TAG: run.stage, **run.tags}
        if parent:
            tags[_PARENT_TAG] = parent
        existing = self.find(run.run_id)
        if existing is None:
            mlrun = self.client.create_run(self.experiment_id(), tags=tags, run_name=run.name)
            old: dict[str, str] = {}
        else:
            mlrun, old = existing, dict(existing.data.params)
            self.client.update_run(mlrun.info.run_id, status="RUNNING", name=run.name)
        mid = mlrun.info.run_id
        changed = sorted(k for k, v in run.params.items() if k in old and old[k] != v)
        if changed:
            log.debug("MLflow run %s keeps the first value of params %s (config.json has the latest)", mid, changed)
        params = [Param(k, v) for k, v in run.params.items() if k not in old]
        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, 0) for k, v in run.metrics.items()]
        run_tags = [RunTag(k, str(v)) for k, v in tags.items()]
        for i in range(0, max(len(params), 1), _BATCH_PARAMS):
            self.client.log_batch(mid, params=params[i : i + _BATCH_PARAMS], tags=run_tags if i == 0 else [])
        for i in range(0, len(metrics), _BATCH_METRICS):
            self.client.log_batch(mid, metrics=metrics[i : i + _BATCH_METRICS])
        for name, text in run.artifacts.items():
            self.client.log_text(mid, text, name)
        self.client.set_terminated(mid, "FINISHED")
        return mid
