"""Telling operators about refused or flagged objects, once per object version.

A relist every few minutes sees the same invalid object again; reporting it again would
inflate the metric and spam Events. A report is keyed by (kind, namespace, name, reason)
and repeats only when the object's resourceVersion changes or the problem went away and
came back. Each report goes to the view (its log line and admin record), the
`pdgate_kubernetes_invalid_objects_total` counter, and a Warning Event when possible.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol

from router.resources import API_VERSION
from router.sources.kube_checks import Problem
from router.sources.kube_events import EventRecorder, ObjectRef
from router.sources.kube_metrics import KubeMetrics

INVALID_SPEC = "InvalidSpec"
#: Reports remembered for de-duplication; beyond it the oldest may be reported again.
MAX_REMEMBERED = 4096

_Key = tuple[str, str, str, str]  # kind, namespace, name, reason


class InvalidSink(Protocol):
    def report_invalid(self, kind: str, name: str, reason: str) -> None: ...


class InvalidReporter:
    def __init__(
        self, sink: InvalidSink, metrics: KubeMetrics, recorder: EventRecorder | None
    ) -> None:
        self._sink = sink
        self._metrics = metrics
        self._recorder = recorder
        self._reported: OrderedDict[_Key, str] = OrderedDict()  # -> resourceVersion

    def invalid(self, ref: ObjectRef, message: str) -> None:
        """`ref` failed schema validation and was not applied."""
        self._report(ref, INVALID_SPEC, message)

    def forget(self, kind: str, namespace: str, name: str) -> None:
        """The object is valid again, or gone: a future failure is news."""
        self._reported.pop((kind, namespace, name, INVALID_SPEC), None)

    def forget_absent(self, kind: str, present: set[tuple[str, str]]) -> None:
        """After a LIST: drop schema reports of objects that no longer exist."""
        for key in [k for k in self._reported if k[0] == kind and k[3] == INVALID_SPEC]:
            if (key[1], key[2]) not in present:
                del self._reported[key]

    def cross_object(self, problems: Iterable[Problem]) -> None:
        """The full current set of cross-object problems; resolved ones are forgotten."""
        current: set[_Key] = set()
        for problem in problems:
            meta = problem.route.meta
            ref = ObjectRef(
                "ModelRoute", API_VERSION, meta.namespace, meta.name, meta.uid,
                meta.resource_version,
            )
            current.add(self._report(ref, problem.code, problem.message))
        for key in [k for k in self._reported if k[3] != INVALID_SPEC and k not in current]:
            del self._reported[key]

    def _report(self, ref: ObjectRef, reason: str, message: str) -> _Key:
        key = (ref.kind, ref.namespace, ref.name, reason)
        if key in self._reported and self._reported[key] == ref.resource_version:
            return key
        self._reported[key] = ref.resource_version
        self._reported.move_to_end(key)
        while len(self._reported) > MAX_REMEMBERED:
            self._reported.popitem(last=False)
        self._metrics.invalid_objects.labels(ref.kind).inc()
        self._sink.report_invalid(ref.kind, f"{ref.namespace}/{ref.name}", f"{reason}: {message}")
        if self._recorder is not None:
            self._recorder.record(ref, reason, message)
        return key

