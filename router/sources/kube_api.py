"""The few API-server calls pdgate makes: LIST, WATCH and POST an Event.

kubernetes-asyncio is called with `_preload_content=False`, so it only builds the URL and
the auth headers and hands back the raw aiohttp response: we parse the JSON ourselves
(no model objects for thousands of pods), and the informer owns retries, timeouts and
resourceVersions (the library's `Watch` reconnects silently and retries a 410 with the
same stale resourceVersion).
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Any, cast

import aiohttp
import orjson
from kubernetes_asyncio import client, config

from router.resources import API_VERSION

log = logging.getLogger(__name__)

#: Connections one router keeps to the API server: three watches, a list each, events.
MAX_CONNECTIONS = 8
#: LIST pages larger than this are parsed in a worker thread, off the event loop.
THREAD_PARSE_BYTES = 1 << 20
#: How much of an error body we read to explain a failed call.
MAX_ERROR_BODY = 64 * 1024
USER_AGENT = "pdgate"
_SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
_TOKEN_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/token"


@dataclass(frozen=True, slots=True)
class ResourceType:
    """One watched collection: its kind, apiVersion and plural path segment."""

    kind: str
    api_version: str  # "v1" for core, "group/version" otherwise
    plural: str

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]


PODS = ResourceType("Pod", "v1", "pods")
MODEL_ROUTES = ResourceType("ModelRoute", API_VERSION, "modelroutes")
MODEL_SERVERS = ResourceType("ModelServer", API_VERSION, "modelservers")


class ApiStatusError(Exception):
    """The API server answered with a non-2xx status (its `Status` reason, if any)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}".strip())
        self.status = status
        self.reason = reason


def in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and os.path.exists(_TOKEN_FILE)


def default_namespace(kubeconfig: str | None = None) -> str:
    """The namespace a router should watch when told none: its own pod's, else the
    kubeconfig context's, else "default" (what kubectl would use)."""
    if kubeconfig is None and in_cluster():
        try:
            with open(_SERVICE_ACCOUNT_NAMESPACE, encoding="utf-8") as handle:
                return handle.read().strip() or "default"
        except OSError:
            return "default"
    try:
        _contexts, current = config.list_kube_config_contexts(config_file=kubeconfig)
    except Exception:
        return "default"
    namespace = (current or {}).get("context", {}).get("namespace")
    return namespace if isinstance(namespace, str) and namespace else "default"


async def make_api_client(kubeconfig: str | None) -> client.ApiClient:
    """An ApiClient with in-cluster credentials inside a pod, else from the kubeconfig.

    An explicit kubeconfig wins even in a pod. The kubeconfig is never written back
    (the root filesystem is read-only in our Deployment).
    """
    configuration = client.Configuration()
    if kubeconfig is None and in_cluster():
        load_incluster: Any = config.load_incluster_config  # untyped in the library
        load_incluster(client_configuration=configuration)
    else:
        await config.load_kube_config(
            config_file=kubeconfig, client_configuration=configuration, persist_config=False
        )
    configuration.connection_pool_maxsize = MAX_CONNECTIONS
    api_client = client.ApiClient(configuration=configuration)
    api_client.user_agent = USER_AGENT
    return api_client


def _timeout(connect_s: float, read_s: float | None) -> aiohttp.ClientTimeout:
    # total=None: aiohttp's default total of 300 s would cut every long watch.
    return aiohttp.ClientTimeout(total=None, sock_connect=connect_s, sock_read=read_s)


class KubeApi:
    """Raw LIST/WATCH of one ResourceType, and Event creation."""

    def __init__(self, api_client: client.ApiClient, connect_timeout_s: float = 10.0) -> None:
        # Any: with _preload_content=False these return raw responses, not the
        # annotated model types.
        self._core = cast(Any, client.CoreV1Api(api_client))
        self._custom = cast(Any, client.CustomObjectsApi(api_client))
        self._connect_timeout_s = connect_timeout_s

    async def list(
        self,
        rt: ResourceType,
        namespace: str | None,
        *,
        label_selector: str | None,
        limit: int,
        continue_token: str | None,
        read_timeout_s: float,
    ) -> dict[str, Any]:
        """One page of a LIST, parsed. Raises ApiStatusError or aiohttp errors."""
        params: dict[str, Any] = {"limit": limit}
        if continue_token:
            params["_continue"] = continue_token
        resp = await self._call(rt, namespace, label_selector, params, read_timeout_s)
        async with resp:
            await raise_for_status(resp)
            body = await resp.read()
        if len(body) > THREAD_PARSE_BYTES:
            page: dict[str, Any] = await asyncio.to_thread(orjson.loads, body)
        else:
            page = orjson.loads(body)
        return page

    async def watch(
        self,
        rt: ResourceType,
        namespace: str | None,
        *,
        label_selector: str | None,
        resource_version: str,
        timeout_seconds: int,
        read_timeout_s: float,
    ) -> aiohttp.ClientResponse:
        """Open a WATCH stream; the caller reads its JSON lines and must release it."""
        params: dict[str, Any] = {
            "watch": True,
            "resource_version": resource_version,
            "allow_watch_bookmarks": True,
            "timeout_seconds": timeout_seconds,
        }
        resp = await self._call(rt, namespace, label_selector, params, read_timeout_s)
        try:
            await raise_for_status(resp)
        except BaseException:
            resp.release()
            raise
        return resp

    async def create_event(self, namespace: str, body: dict[str, Any]) -> None:
        resp = await self._core.create_namespaced_event(
            namespace,
            body,
            _preload_content=False,
            _request_timeout=_timeout(self._connect_timeout_s, self._connect_timeout_s),
        )
        async with resp:
            await raise_for_status(resp)

    async def _call(
        self,
        rt: ResourceType,
        namespace: str | None,
        label_selector: str | None,
        params: dict[str, Any],
        read_timeout_s: float,
    ) -> aiohttp.ClientResponse:
        kwargs = dict(params)
        if label_selector:
            kwargs["label_selector"] = label_selector
        kwargs["_preload_content"] = False
        kwargs["_request_timeout"] = _timeout(self._connect_timeout_s, read_timeout_s)
        if rt.group == "":
            if rt.plural != "pods":
                raise ValueError(f"unsupported core resource {rt.plural}")
            if namespace is None:
                resp = await self._core.list_pod_for_all_namespaces(**kwargs)
            else:
                resp = await self._core.list_namespaced_pod(namespace, **kwargs)
        elif namespace is None:
            resp = await self._custom.list_cluster_custom_object(
                rt.group, rt.version, rt.plural, **kwargs
            )
        else:
            resp = await self._custom.list_namespaced_custom_object(
                rt.group, rt.version, namespace, rt.plural, **kwargs
            )
        if not isinstance(resp, aiohttp.ClientResponse):
            raise TypeError(f"expected a raw response, got {type(resp).__name__}")
        return resp


async def raise_for_status(resp: aiohttp.ClientResponse) -> None:
    """Raise ApiStatusError with the `Status` object's reason and message on non-2xx."""
    if 200 <= resp.status < 300:
        return
    reason, message = resp.reason or "", ""
    try:
        body = await resp.content.read(MAX_ERROR_BODY)
        status = orjson.loads(body)
        if isinstance(status, dict):
            reason = str(status.get("reason") or reason)
            message = str(status.get("message") or "")
    except (aiohttp.ClientError, orjson.JSONDecodeError, TimeoutError):
        pass
    raise ApiStatusError(resp.status, reason, message)
