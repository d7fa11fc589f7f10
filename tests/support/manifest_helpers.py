"""deploy/kubernetes rendered as a cluster would receive it, and looked up by kind and name.

`render` runs `kubectl kustomize` (the kubectl on PATH; its built-in kustomize) and reads
the YAML back; `Manifests` finds objects, the containers of every workload, the headless
Service and StatefulSet behind a `POD.SERVICE` address, and a container's ports.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = REPO_ROOT / "deploy" / "kubernetes"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")

Obj = dict[str, Any]


def kustomizations() -> list[Path]:
    """Every kustomization under deploy/ (base, overlays, and the Grafana dashboard's)."""
    return sorted(p.parent for p in (REPO_ROOT / "deploy").rglob("kustomization.yaml"))


def kubectl() -> str:
    """kubectl from PATH; fails the test (never skips) without one."""
    found = shutil.which("kubectl")
    if found is None:
        pytest.fail("no kubectl on PATH: the manifests are rendered with `kubectl kustomize`")
    return found


def render(directory: Path) -> Manifests:
    """`kubectl kustomize directory`, parsed.

    Raises:
        AssertionError: kustomize failed (with its message).
    """
    done = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"kubectl kustomize {directory}:\n{done.stderr}"
    return Manifests([o for o in yaml.safe_load_all(done.stdout) if o])


@dataclass(frozen=True)
class Container:
    """One container of a workload's pod template."""

    workload: Obj
    spec: Obj

    @property
    def name(self) -> str:
        return f"{self.workload['kind']}/{self.workload['metadata']['name']}/{self.spec['name']}"

    @property
    def argv(self) -> list[str]:
        """command + args, as the kubelet runs them."""
        return [*self.spec.get("command", []), *self.spec.get("args", [])]

    def flag(self, name: str) -> str | None:
        """The value after `name` (or in `name=value`), if the container passes it."""
        argv = self.argv
        for i, arg in enumerate(argv):
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(f"{name}="):
                return arg.split("=", 1)[1]
        return None

    def has_flag(self, name: str) -> bool:
        return name in self.argv

    def ports(self) -> dict[str, int]:
        return {p["name"]: p["containerPort"] for p in self.spec.get("ports", [])}

    def port_number(self, port: int | str) -> int:
        """A probe's or Service's port (a number or a named container port) as a number."""
        return port if isinstance(port, int) else self.ports()[port]


@dataclass(frozen=True)
class Manifests:
    """The objects one kustomization renders to."""

    objects: list[Obj]

    def of_kind(self, kind: str) -> list[Obj]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str) -> Obj:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"{len(found)} {kind} named {name}"
        return found[0]

    def named_prefix(self, kind: str, prefix: str) -> Obj:
        """The one object of `kind` whose name is `prefix` plus a generator's hash."""
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"].startswith(prefix + "-")]
        assert len(found) == 1, f"{len(found)} {kind} named {prefix}-<hash>"
        return found[0]

    def workloads(self) -> list[Obj]:
        return [o for o in self.objects if o["kind"] in WORKLOADS]

    def containers(self) -> Iterator[Container]:
        for w in self.workloads():
            for spec in w["spec"]["template"]["spec"]["containers"]:
                yield Container(w, spec)

    def container(self, kind: str, name: str) -> Container:
        (spec,) = self.one(kind, name)["spec"]["template"]["spec"]["containers"]
        return Container(self.one(kind, name), spec)

    def pod_address(self, host: str) -> tuple[Obj, Container, Obj]:
        """`POD.SERVICE` -> (its headless Service, its StatefulSet's container, the
        StatefulSet), checking the pod exists: ordinal below the replica count."""
        pod, _, service_name = host.partition(".")
        service = self.one("Service", service_name)
        assert service["spec"].get("clusterIP") == "None", f"{service_name} is not headless"
        sets = [s for s in self.of_kind("StatefulSet") if s["spec"]["serviceName"] == service_name]
        assert len(sets) == 1, f"no StatefulSet governed by {service_name}"
        stateful = sets[0]
        base, _, ordinal = pod.rpartition("-")
        assert base == stateful["metadata"]["name"] and ordinal.isdigit(), host
        assert int(ordinal) < stateful["spec"]["replicas"], f"{host}: no such pod"
        return service, self.container("StatefulSet", base), stateful

    def service_ports(self, service: Obj) -> set[int]:
        return {p["port"] for p in service["spec"]["ports"]}
