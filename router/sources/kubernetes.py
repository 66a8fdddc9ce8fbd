"""`pdgate serve --kubernetes`: ModelRoutes, ModelServers and Pods from the API server.

Three informers (list-then-watch, see kube_informer) feed the ClusterView. Pods are
listed only after the ModelServers, so their watch can be narrowed to the label values the
ModelServers select (see kube_selector); a change of that selector relists the pods.
`synced` turns true once all three have listed and stays true while the API server is
unreachable: the router keeps serving the last good state rather than dropping out.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

from kubernetes_asyncio.client import ApiClient
from prometheus_client import CollectorRegistry

from router.resources import ModelRoute, ModelServer
from router.sources.kube_api import (
    MODEL_ROUTES,
    MODEL_SERVERS,
    PODS,
    KubeApi,
    make_api_client,
)
from router.sources.kube_backoff import Backoff
from router.sources.kube_checks import route_problems
from router.sources.kube_events import EventLimits, EventRecorder
from router.sources.kube_handler import KindHandler
from router.sources.kube_informer import Informer, WatchTiming
from router.sources.kube_invalid import InvalidReporter
from router.sources.kube_metrics import KubeMetrics
from router.sources.kube_selector import pod_selector
from router.view import ClusterView

log = logging.getLogger(__name__)


class KubernetesSource:
    """A Source that watches one namespace (or all, with `namespace=None`).

    `kubeconfig=None` means in-cluster credentials inside a pod, else the default
    kubeconfig (`$KUBECONFIG` or `~/.kube/config`). Metrics go into `registry`.
    `timing` and `event_limits` exist for tests; the defaults are the production values.
    """

    def __init__(
        self,
        namespace: str | None,
        kubeconfig: str | None,
        registry: CollectorRegistry,
        *,
        timing: WatchTiming | None = None,
        post_events: bool = True,
        event_limits: EventLimits | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.namespace = namespace
        self._kubeconfig = kubeconfig
        self._timing = timing or WatchTiming()
        self._rng = rng or random.Random()
        self._metrics = KubeMetrics(registry)
        self._recorder = EventRecorder(self._metrics, event_limits) if post_events else None
        self._informers: dict[str, Informer] = {}
        self._metrics.track_synced(lambda: self.synced)

    @property
    def synced(self) -> bool:
        return len(self._informers) == 3 and all(i.synced for i in self._informers.values())

    @property
    def recorder(self) -> EventRecorder | None:
        """The Warning Event recorder (None when Events are off), for other notices."""
        return self._recorder

    @property
    def pod_label_selector(self) -> str | None:
        """The label selector of the current pod LIST/WATCH (None: every pod in scope)."""
        pods = self._informers.get(PODS.plural)
        return pods.label_selector if pods else None

    async def run(self, view: ClusterView) -> None:
        api_client = await self._connect()
        try:
            await self._run(view, KubeApi(api_client, self._timing.connect_timeout_s))
        finally:
            await api_client.close()

    async def _connect(self) -> ApiClient:
        backoff = Backoff(self._timing.backoff, self._rng)
        while True:
            try:
                return await make_api_client(self._kubeconfig)
            except Exception as exc:  # missing or broken kubeconfig, no service account
                delay = backoff.next_delay()
                log.error("cannot load Kubernetes credentials (%s); retrying in %.1fs",
                          exc, delay)
                await asyncio.sleep(delay)

    async def _run(self, view: ClusterView, api: KubeApi) -> None:
        reporter = InvalidReporter(view, self._metrics, self._recorder)
        servers = KindHandler(MODEL_SERVERS, view, self.namespace, reporter)
        routes = KindHandler(MODEL_ROUTES, view, self.namespace, reporter)
        pods = KindHandler(PODS, view, self.namespace, reporter)

        def wanted_pod_selector() -> str | None:
            return pod_selector(
                s.match_labels for s in servers.good.values() if isinstance(s, ModelServer)
            )

        def informer(
            handler: KindHandler, selector: Callable[[], str | None] = lambda: None
        ) -> Informer:
            return Informer(
                handler.rt, api, handler, namespace=self.namespace, metrics=self._metrics,
                timing=self._timing, selector=selector, rng=self._rng,
            )

        server_informer = informer(servers)
        route_informer = informer(routes)
        pod_informer = informer(pods, wanted_pod_selector)
        self._informers = {i.resource: i for i in (server_informer, route_informer, pod_informer)}

        def check_routes() -> None:
            if routes.listed and servers.listed:
                reporter.cross_object(
                    route_problems(
                        (r for r in routes.good.values() if isinstance(r, ModelRoute)),
                        servers.good.keys(),
                    )
                )

        def servers_changed() -> None:
            if wanted_pod_selector() != pod_informer.label_selector:
                pod_informer.restart("selector_changed")
            check_routes()

        servers.on_change = servers_changed
        routes.on_change = check_routes

        async def pods_after_servers() -> None:
            await server_informer.listed.wait()
            await pod_informer.run()

        async with asyncio.TaskGroup() as tasks:
            if self._recorder is not None:
                tasks.create_task(self._recorder.run(api.create_event))
            tasks.create_task(server_informer.run())
            tasks.create_task(route_informer.run())
            tasks.create_task(pods_after_servers())
