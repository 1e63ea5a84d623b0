"""deploy/: what an operator would otherwise find out while building images or
rolling out. No Docker daemon and no cluster are needed, and nothing leaves
this host:

- the Kubernetes manifests against the API schemas (strict: unknown fields
  fail), and what the schemas cannot say: probes, limits, hardening, that
  every reference resolves, which pod may reach which port;
- compose.yaml against the Compose Specification's schema, and its health
  checks, restart policies, start order, secrets;
- the images' inputs: every COPY source reaches the build context, nothing
  else does (not .venv, .git or the secrets), every package is pinned, the
  collector image's short dependency list is enough for the collector;
- the wheel, built from exactly the build context with stubs generated;
- live, on loopback: Redis started with the deployment's own command line
  (TLS only, password required), the collector and analyzer started with
  the deployment's own settings and certificates from deploy/make-secrets.sh,
  answering the health probe the deployment configures (and refusing it
  without a client certificate or token), and a worker answering its probe.
"""
from __future__ import annotations

import copy
import importlib.metadata as md
import json
import os
import re
import select
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import time
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from ports import free_port

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERFILE_COLLECTOR = DEPLOY / "Dockerfile.collector"
DOCKERFILES = (DOCKERFILE, DOCKERFILE_COLLECTOR)
CONSTRAINTS = DEPLOY / "constraints.txt"
COLLECTOR_REQUIREMENTS = DEPLOY / "requirements-collector.txt"
IMAGE_UID = 10001
# Of the project's own files, the build context may leave out only caches, the
# kernels built for this host's CPU
# and the generated stubs (the image build generates those from the .proto files).
REGENERATED_OR_CACHE = re.compile(r"(^|/)(__pycache__|[^/]*\.egg-info)(/|$)|\.py[cod]$|_pb2(_grpc)?\.pyi?$"
                                  r"|(^|/)_kernels\.[^/]*$")


# ===================================================================== helpers
def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def base_env() -> dict:
    """This environment without any layerdiff setting of the caller's."""
    return {k: v for k, v in os.environ.items() if not k.startswith("LAYERDIFF_")}


# ---------------------------------------------------------------- .dockerignore
def _glob_regex(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as Docker reads it: Go's filepath.Match within
    a path segment ('*', '?', '[...]'), '**' for any number of segments."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                i += 1
                out.append("(?:.*/)?")
            else:
                out.append(".*")
            continue
        c = pattern[i]
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = pattern.index("]", i + 1)
            body = pattern[i + 1:j]
            out.append("[" + ("^" + body[1:] if body[:1] in ("^", "!") else body) + "]")
            i = j
        elif c == "\\":
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out))


class DockerIgnore:
    """Docker's rule: the last pattern matching a path, or any directory
    above it, decides; a '!' pattern brings the path back."""

    def __init__(self, text: str) -> None:
        self.rules: list[tuple[bool, re.Pattern, str]] = []
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            keep = line.startswith("!")
            pattern = os.path.normpath(line[1:].strip() if keep else line).lstrip("/")
            self.rules.append((keep, _glob_regex(pattern), pattern))

    def excluded(self, path: str) -> bool:
        parts = path.strip("/").split("/")
        prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
        out = False
        for keep, rx, _ in self.rules:
            if any(rx.fullmatch(p) for p in prefixes):
                out = not keep
        return out

    def may_bring_back_below(self, directory: str) -> bool:
        return any(keep and (p.startswith(directory + "/") or p.startswith("*")) for keep, _, p in self.rules)


def dockerignore() -> DockerIgnore:
    return DockerIgnore((ROOT / ".dockerignore").read_text())


def context_files() -> list[str]:
    """Every file `docker build .` would send, relative to the repository."""
    ig, found = dockerignore(), []
    for top, dirs, files in os.walk(ROOT):
        rel_top = Path(top).relative_to(ROOT).as_posix()
        rel_top = "" if rel_top == "." else rel_top + "/"
        links = [d for d in dirs if os.path.islink(os.path.join(top, d))]     # sent as links (src/layerdiff)
        dirs[:] = [d for d in dirs if d not in links
                   and not (ig.excluded(rel_top + d) and not ig.may_bring_back_below(rel_top + d))]
        found += [rel_top + f for f in files + links if not ig.excluded(rel_top + f)]
    return sorted(found)


# ----------------------------------------------------------------- Dockerfiles
def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        s = raw.strip()
        if s.startswith("#") or (not s and not buf):
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        buf += s
        instr, _, rest = buf.partition(" ")
        out.append((instr.upper(), rest.strip()))
        buf = ""
    return out


def final_stage(path: Path) -> list[tuple[str, str]]:
    instrs = dockerfile_instructions(path)
    last = max(i for i, (ins, _) in enumerate(instrs) if ins == "FROM")
    return instrs[last:]


def copies(path: Path) -> list[tuple[list[str], list[str], str]]:
    """(flags, sources, destination) of every COPY/ADD."""
    out = []
    for ins, rest in dockerfile_instructions(path):
        if ins not in ("COPY", "ADD"):
            continue
        args = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
        flags = [a for a in args if a.startswith("--")]
        args = [a for a in args if not a.startswith("--")]
        out.append((flags, args[:-1], args[-1]))
    return out


def context_sources(path: Path) -> list[str]:
    return [s for flags, srcs, _ in copies(path) if not any(f.startswith("--from") for f in flags) for s in srcs]


def arg_default(path: Path, name: str) -> str:
    for ins, rest in dockerfile_instructions(path):
        if ins == "ARG" and rest.split("=", 1)[0] == name:
            return rest.split("=", 1)[1] if "=" in rest else ""
    raise AssertionError(f"{path.name} declares no ARG {name}")


def requirement_names(path: Path) -> list[str]:
    from packaging.requirements import Requirement

    return [canon(Requirement(line).name) for line in
            (raw.split("#", 1)[0].strip() for raw in path.read_text().splitlines()) if line]


def constraints() -> dict[str, str]:
    pins = {}
    for raw in CONSTRAINTS.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)", line)
            assert m, f"constraints.txt: {raw!r} is not NAME==VERSION"
            assert canon(m.group(1)) not in pins, f"constraints.txt pins {m.group(1)} twice"
            pins[canon(m.group(1))] = m.group(2)
    return pins


def installed_closure(roots: list[str]) -> set[str]:
    """Canonical names of ``roots`` and all they require, as installed here."""
    from packaging.requirements import Requirement

    seen, todo, names = set(), [(Requirement(r), frozenset()) for r in roots], set()
    while todo:
        req, extras = todo.pop()
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (sorted(extras) or [""])):
            continue
        key = (canon(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        names.add(canon(req.name))
        todo += [(Requirement(r), frozenset(req.extras)) for r in (md.distribution(req.name).requires or [])]
    return names


def collector_packages() -> list[str]:
    """What deploy/Dockerfile.collector installs besides the project itself."""
    return requirement_names(COLLECTOR_REQUIREMENTS) + [canon(arg_default(DOCKERFILE_COLLECTOR, "ORT_PACKAGE"))]


# ---------------------------------------------------------------- manifests
def k8s_documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def workloads() -> list[dict]:
    return [d for _, d in k8s_documents() if d["kind"] in ("Deployment", "DaemonSet", "StatefulSet")]


def component(doc: dict) -> str:
    return doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


def workload(name: str) -> dict:
    return next(w for w in workloads() if component(w) == name)


def is_layerdiff(container: dict) -> bool:
    return "layerdiff" in container["image"]


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def interpolate(value, env: dict):
    """Compose's variable interpolation (${X}, ${X:-default}, ${X:?error}, $$)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m):
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group("name") or m.group("bare"), m.group("op"), m.group("arg")
        have = env.get(name)
        if op in (":-", "-"):
            return have if have or (op == "-" and have is not None) else arg
        if op in (":?", "?"):
            if not have:
                raise AssertionError(f"compose would refuse: {name} unset ({arg})")
            return have
        return have or ""

    return re.sub(r"\$\$|\$\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|\$(?P<bare>[A-Za-z_]\w*)", one, value)


def argv_of(service: dict) -> list[str]:
    cmd = service["command"]
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# ============================================================ Kubernetes schema
@pytest.fixture(scope="module")
def k8s_version() -> str:
    from kubernetes_validate import utils

    return utils.latest_version()


@pytest.mark.parametrize("doc", [d for _, d in k8s_documents()],
                         ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in k8s_documents()])
def test_manifest_validates_strictly(doc, k8s_version):
    import kubernetes_validate

    kubernetes_validate.validate(doc, k8s_version, strict=True)


def test_strict_validation_catches_a_misspelt_field(k8s_version):
    """Guards the test above: a typo in a probe name must not pass."""
    import kubernetes_validate

    doc = copy.deepcopy(workload("analyzer"))
    container = doc["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, k8s_version, strict=True)


def test_manifest_kinds():
    kinds = {(d["kind"], d["metadata"]["name"]) for _, d in k8s_documents()}
    for want in [("Deployment", "analyzer"), ("Deployment", "worker"), ("DaemonSet", "collector"),
                 ("Deployment", "redis"), ("Service", "redis"), ("Service", "analyzer")]:
        assert want in kinds
    assert {k for k, _ in kinds} >= {"Namespace", "Secret", "NetworkPolicy"}
    namespaces = {d["metadata"]["name"] for _, d in k8s_documents() if d["kind"] == "Namespace"}
    for _, d in k8s_documents():
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") in namespaces, f"{d['kind']}/{d['metadata']['name']}"


# ===================================================== Kubernetes: what runs
@pytest.mark.parametrize("name", ["analyzer", "worker", "collector", "redis"])
def test_pods_are_hardened_and_bounded(name):
    w = workload(name)
    pod = w["spec"]["template"]["spec"]
    assert pod.get("automountServiceAccountToken") is False
    psc = pod.get("securityContext", {})
    assert psc.get("runAsNonRoot") is True and psc.get("runAsUser", 0) > 0
    assert psc.get("seccompProfile", {}).get("type") == "RuntimeDefault"
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for c in pod["containers"] + pod.get("initContainers", []):
        sc = c.get("securityContext", {})
        assert sc.get("allowPrivilegeEscalation") is False, c["name"]
        assert sc.get("readOnlyRootFilesystem") is True, c["name"]
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], c["name"]
        assert not sc.get("privileged"), c["name"]
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c.get("resources", {}).get(kind, {})), f"{c['name']}: {kind}"
        for probe in ("readinessProbe", "livenessProbe"):
            assert "exec" in c.get(probe, {}), f"{c['name']}: {probe} must be an exec probe (the services use TLS)"
        mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
        assert "/tmp" in mounts and "emptyDir" in volumes[mounts["/tmp"]["name"]], f"{c['name']}: /tmp"
        if is_layerdiff(c):
            assert psc["runAsUser"] == IMAGE_UID, "the images' user"
            args = c.get("args", [])
            if "--workdir" in args:
                work = mounts.get(option(args, "--workdir"))
                assert work, f"{c['name']}: its work directory is on the read-only root"
                assert {"emptyDir", "persistentVolumeClaim"} & set(volumes[work["name"]]), c["name"]


def test_images_run_as_the_uid_the_manifests_name():
    for path in DOCKERFILES:
        users = [rest for ins, rest in final_stage(path) if ins == "USER"]
        assert users, f"{path.name}: no USER: the image would run as root"
        uid = users[-1].split(":")[0]
        assert uid.isdigit() and int(uid) == IMAGE_UID, f"{path.name}: USER {users[-1]} (numeric, for runAsNonRoot)"


def _probe_commands(c: dict) -> list[list[str]]:
    return [c[p]["exec"]["command"] for p in ("startupProbe", "readinessProbe", "livenessProbe") if p in c]


@pytest.mark.parametrize("name", ["analyzer", "collector"])
def test_k8s_probes_ask_the_port_the_service_listens_on(name):
    c = workload(name)["spec"]["template"]["spec"]["containers"][0]
    port = option(c["args"], "--port")
    assert int(port) in {p["containerPort"] for p in c["ports"]}
    for cmd in _probe_commands(c):
        assert f"layerdiff health 127.0.0.1:{port}" in " ".join(cmd), cmd
    assert c["readinessProbe"]["exec"]["command"] == ["layerdiff", "health", f"127.0.0.1:{port}"]


def test_worker_probe_is_installed_in_the_image():
    installed = {Path(dest).name for _, srcs, dest in copies(DOCKERFILE) if "deploy/worker-health" in srcs}
    assert installed, "deploy/Dockerfile does not install deploy/worker-health"
    c = workload("worker")["spec"]["template"]["spec"]["containers"][0]
    for cmd in _probe_commands(c):
        assert cmd[0] in installed, cmd
    assert compose()["services"]["worker"]["healthcheck"]["test"][1] in installed


def test_k8s_references_resolve():
    """Volumes, Secrets and their keys, env paths inside mounts, Service selectors and ports."""
    docs = [d for _, d in k8s_documents()]
    secrets = {(d["metadata"]["namespace"], d["metadata"]["name"]):
               set(d.get("stringData", {})) | set(d.get("data", {}))
               for d in docs if d["kind"] == "Secret"}
    for w in workloads():
        ns, pod = w["metadata"]["namespace"], w["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in pod["containers"]:
            files = set()
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{c['name']}: mount of undefined volume {m['name']}"
                sv = volumes[m["name"]].get("secret")
                if sv:
                    keys = secrets.get((ns, sv["secretName"]))
                    assert keys is not None, f"{c['name']}: Secret {ns}/{sv['secretName']} is not defined"
                    items = sv.get("items") or [{"key": k, "path": k} for k in keys]
                    for it in items:
                        assert it["key"] in keys, f"Secret {sv['secretName']} has no key {it['key']}"
                        files.add(f"{m['mountPath']}/{it['path']}")
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets.get((ns, ref["name"]), set()), f"{c['name']}: {e['name']}"
                for path in re.findall(r"(/etc/layerdiff/\S+?)(?=$|[&\s])", e.get("value", "")):
                    assert path in files, f"{c['name']}: {e['name']} names {path}, which no mounted Secret provides"
    for svc in (d for d in docs if d["kind"] == "Service"):
        targets = [w for w in workloads() if w["metadata"]["namespace"] == svc["metadata"]["namespace"] and
                   all(w["spec"]["template"]["metadata"]["labels"].get(k) == v
                       for k, v in svc["spec"]["selector"].items())]
        assert targets, f"Service {svc['metadata']['name']} selects no pod"
        ports = {p["containerPort"] for w in targets for c in w["spec"]["template"]["spec"]["containers"]
                 for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, f"Service {svc['metadata']['name']}: targetPort {p['targetPort']}"


def _quantity(text: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    m = re.fullmatch(r"(\d+)([KMGT]i?)?", str(text))
    return int(m.group(1)) * units.get(m.group(2) or "", 1)


@pytest.mark.parametrize("name", ["analyzer", "collector"])
def test_what_a_service_keeps_fits_its_work_volume(name, monkeypatch):
    """An emptyDir filled past its sizeLimit evicts the pod (and every job in it): the
    service's own bounds (retention, upload quota, as it reads them) must stop it first."""
    from layerdiff.analyzer.jobs.records import Retention
    from layerdiff.common.artifacts import quota_bytes

    pod = workload(name)["spec"]["template"]["spec"]
    c = pod["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == option(c["args"], "--workdir"))
    limit = _quantity(next(v for v in pod["volumes"] if v["name"] == mount["name"])["emptyDir"]["sizeLimit"])
    for k in [k for k in os.environ if k.startswith("LAYERDIFF_")]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert str(quota_bytes()) == env.get("LAYERDIFF_ARTIFACT_QUOTA_BYTES"), \
        "the upload quota is unset or unreadable (it falls back to 64 GiB)"
    kept = quota_bytes() + (Retention.from_env(env).max_bytes if name == "analyzer" else 0)
    assert kept < limit, f"{name} may keep {kept / 2**30:.1f} GiB in a {limit / 2**30:.1f} GiB work volume"


def test_collectors_read_the_host_dump_root_read_only():
    ds = workload("collector")
    assert ds["kind"] == "DaemonSet"
    pod = ds["spec"]["template"]["spec"]
    assert pod.get("nodeSelector") and pod.get("tolerations"), "placeholders for the accelerator nodes"
    c = pod["containers"][0]
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = [m for m in c["volumeMounts"] if m["name"] in host_paths]
    assert mounts and all(m.get("readOnly") is True for m in mounts)
    env = {e["name"]: e.get("value") for e in c["env"]}
    roots = env["LAYERDIFF_DUMP_ROOTS"].split(":")
    assert roots == [m["mountPath"] for m in mounts]
    assert all(host_paths[m["name"]] == m["mountPath"] for m in mounts), "dump paths mean the same in and out"
    # hostPath and hostPort only here, in the namespace that does not enforce the restricted profile
    ns = {d["metadata"]["name"]: d["metadata"].get("labels", {})
          for _, d in k8s_documents() if d["kind"] == "Namespace"}
    for w in workloads():
        p = w["spec"]["template"]["spec"]
        exposed = any("hostPath" in v for v in p.get("volumes", [])) or any(
            "hostPort" in port for c in p["containers"] for port in c.get("ports", []))
        enforce = ns[w["metadata"]["namespace"]].get("pod-security.kubernetes.io/enforce")
        assert exposed == (enforce == "privileged"), f"{component(w)}: Pod Security {enforce}"
        assert not (p.get("hostNetwork") or p.get("hostPID") or p.get("hostIPC"))
    assert ns["layerdiff"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_secret_placeholders_are_refused_by_the_services():
    """A forgotten placeholder stops the pod instead of running it with a known credential."""
    from layerdiff.common.errors import LayerdiffError
    from layerdiff.common.security import Tokens

    for _, d in k8s_documents():
        if d["kind"] != "Secret":
            continue
        for key, value in d.get("stringData", {}).items():
            assert "REPLACE-ME" in value, f"{d['metadata']['name']}/{key} is not marked as a placeholder"
            if key.endswith((".tokens", ".token")):
                with pytest.raises(LayerdiffError):
                    Tokens.parse(value, key)
            if key in ("task_secret", "password"):
                assert len(value.strip()) < 16, f"{d['metadata']['name']}/{key} would be accepted"


# ------------------------------------------------------------ NetworkPolicy
@dataclass(frozen=True)
class Pod:
    ns: str
    labels: tuple
    name: str = ""

    def label(self) -> dict:
        return dict(self.labels)


def _selects(selector: dict, labels: dict) -> bool:
    assert not selector.get("matchExpressions"), "only matchLabels is evaluated here"
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def _peer_matches(peer: dict, policy_ns: str, pod: Pod | None, ns_labels: dict) -> bool:
    if pod is None:      # a client outside the cluster
        return "ipBlock" in peer
    if "ipBlock" in peer:
        return False
    ns_ok = (pod.ns == policy_ns if "namespaceSelector" not in peer
             else _selects(peer["namespaceSelector"], ns_labels.get(pod.ns, {})))
    return ns_ok and ("podSelector" not in peer or _selects(peer["podSelector"], pod.label()))


def _allowed(direction: str, subject: Pod, peer: Pod | None, port: int, proto: str, policies, ns_labels) -> bool:
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    relevant = [p for p in policies if p["metadata"]["namespace"] == subject.ns
                and _selects(p["spec"]["podSelector"], subject.label()) and direction in p["spec"]["policyTypes"]]
    if not relevant:
        return True
    for pol in relevant:
        for rule in pol["spec"].get(key) or []:
            peers = rule.get(peers_key)
            peer_ok = not peers or any(_peer_matches(x, pol["metadata"]["namespace"], peer, ns_labels) for x in peers)
            ports = rule.get("ports")
            port_ok = not ports or any(p.get("port") in (None, port) and p.get("protocol", "TCP") == proto
                                       for p in ports)
            if peer_ok and port_ok:
                return True
    return False


def test_network_policy_allows_exactly_the_paths_the_services_use():
    docs = [d for _, d in k8s_documents()]
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    ns_labels = {d["metadata"]["name"]: {**d["metadata"].get("labels", {}),
                                         "kubernetes.io/metadata.name": d["metadata"]["name"]}
                 for d in docs if d["kind"] == "Namespace"}
    ns_labels["kube-system"] = {"kubernetes.io/metadata.name": "kube-system"}
    pods = {component(w): Pod(w["metadata"]["namespace"],
                              tuple(sorted(w["spec"]["template"]["metadata"]["labels"].items())), component(w))
            for w in workloads()}
    ports = {component(w): {p["containerPort"] for c in w["spec"]["template"]["spec"]["containers"]
                            for p in c.get("ports", [])} for w in workloads()}
    for ns in {p.ns for p in pods.values()}:
        assert any(p["metadata"]["namespace"] == ns and p["spec"]["podSelector"] == {}
                   and set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"} and not p["spec"].get("ingress")
                   and not p["spec"].get("egress") for p in policies), f"no default deny in {ns}"

    reachable = set()
    for src, s in pods.items():
        for dst, d in pods.items():
            for port in ports[dst]:
                if src != dst and _allowed("Egress", s, d, port, "TCP", policies, ns_labels) and \
                        _allowed("Ingress", d, s, port, "TCP", policies, ns_labels):
                    reachable.add((src, dst, port))
    assert reachable == {("analyzer", "redis", 6380), ("worker", "redis", 6380),
                         ("analyzer", "collector", 50051), ("worker", "analyzer", 50053)}
    from_outside = {(dst, port) for dst, d in pods.items() for port in ports[dst]
                    if _allowed("Ingress", d, None, port, "TCP", policies, ns_labels)}
    assert from_outside == {("analyzer", 50052)}, "only the analyzer's API faces clients"
    dns = Pod("kube-system", (("k8s-app", "kube-dns"),))
    for name in ("analyzer", "worker"):
        assert _allowed("Egress", pods[name], dns, 53, "UDP", policies, ns_labels), f"{name} cannot resolve names"


# ==================================================================== compose
def test_compose_file_follows_the_compose_specification():
    """Against the Compose Specification's schema (deploy/schema), as `docker compose config` checks it."""
    import jsonschema

    validator = jsonschema.Draft7Validator(json.loads((DEPLOY / "schema" / "compose-spec.json").read_text()))
    doc = compose()
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]
    assert not errors, errors
    doc["services"]["analyzer"]["healthcheck"]["intervall"] = "3s"      # a typo must not pass
    assert not validator.is_valid(doc)


def test_compose_services_are_probed_restarted_and_started_in_order():
    services = compose()["services"]
    assert set(services) >= {"redis", "collector", "analyzer", "worker"}
    for name, svc in services.items():
        assert svc.get("healthcheck", {}).get("test"), f"{name}: no healthcheck"
        assert svc.get("restart") in ("always", "unless-stopped", "on-failure"), f"{name}: no restart policy"
        deps = svc.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: depends_on without conditions only waits for a start"
        for dep, cond in deps.items():
            assert cond.get("condition") == "service_healthy", f"{name} -> {dep}"
            assert "healthcheck" in services[dep]
    for name in ("analyzer", "worker"):
        assert "redis" in services[name]["depends_on"], f"{name} needs the broker"
    assert services["worker"]["deploy"]["replicas"] == 2
    for name in ("collector", "analyzer", "worker"):
        svc = services[name]
        assert svc.get("read_only") is True and svc.get("cap_drop") == ["ALL"], name
        assert "no-new-privileges:true" in svc.get("security_opt", []), name
        assert not svc.get("privileged") and svc.get("user") in (None, str(IMAGE_UID)), name
        assert svc["deploy"]["resources"]["limits"], name
    assert services["collector"]["build"]["dockerfile"] == "deploy/Dockerfile.collector"
    assert services["analyzer"]["build"]["dockerfile"] == "deploy/Dockerfile"


@pytest.mark.parametrize("name", ["collector", "analyzer"])
def test_compose_probes_ask_the_port_the_service_listens_on(name):
    svc = compose()["services"][name]
    port = option(argv_of(svc), "--port")
    assert svc["healthcheck"]["test"] == ["CMD", "layerdiff", "health", f"127.0.0.1:{port}"]


def test_compose_redis_demands_a_password_and_tls():
    redis = compose()["services"]["redis"]
    script = " ".join(argv_of(redis))
    assert "requirepass" in script and "--port 0" in script and "--tls-port" in script
    assert "${REDIS_PASSWORD:?" in redis["environment"]["REDIS_PASSWORD"], "an unset password must stop compose"
    with pytest.raises(AssertionError, match="REDIS_PASSWORD"):
        interpolate(compose()["services"], {})
    tls_port = re.search(r"--tls-port (\d+)", script).group(1)
    for name in ("analyzer", "worker"):
        url = compose()["services"][name]["environment"]["LAYERDIFF_BROKER_URL"]
        assert re.fullmatch(rf"rediss://:\$\{{REDIS_PASSWORD[^}}]*\}}@redis:{tls_port}/0\?(.+)", url), url
        assert "ssl_cert_reqs=required" in url and "ssl_ca_certs=/run/secrets/" in url


def test_compose_secrets_are_mounted_where_used(secrets_dir):
    doc = compose()
    defined = doc["secrets"]
    written = {p.name for p in secrets_dir.iterdir()}
    for name, s in defined.items():
        assert s["file"].startswith("./secrets/") and Path(s["file"]).name in written, \
            f"secret {name}: {s['file']} is not something deploy/make-secrets.sh writes"
    for name, svc in doc["services"].items():
        mounted = set(svc.get("secrets", []))
        assert mounted <= set(defined), name
        used = set(re.findall(r"/run/secrets/([\w.-]+)", json.dumps([svc.get("environment"), svc.get("command"),
                                                                       svc.get("healthcheck")])))
        assert used <= mounted, f"{name} uses {sorted(used - mounted)} without mounting them"


def _settings_in_deploy() -> set[str]:
    names = set()
    for svc in compose()["services"].values():
        names |= {k for k in (svc.get("environment") or {}) if k.startswith("LAYERDIFF_")}
    for w in workloads():
        for c in w["spec"]["template"]["spec"]["containers"]:
            names |= {e["name"] for e in c.get("env", []) if e["name"].startswith("LAYERDIFF_")}
    return names


def test_every_setting_deployed_is_one_the_services_read():
    """A misspelt variable is silently ignored: TLS or tokens would just be off."""
    source = "\n".join(p.read_text() for p in (ROOT / "services").rglob("*.py"))
    names = _settings_in_deploy()
    assert {"LAYERDIFF_TOKEN_FILE", "LAYERDIFF_TLS_CERT", "LAYERDIFF_TLS_KEY", "LAYERDIFF_TLS_CA",
            "LAYERDIFF_BROKER_URL", "LAYERDIFF_TASK_SECRET_FILE", "LAYERDIFF_DUMP_ROOTS",
            "LAYERDIFF_COLLECTOR_ALLOW"} <= names
    unread = sorted(n for n in names if not re.search(rf"\b{n}\b", source))
    assert not unread, f"set in deploy/ but read nowhere in services/: {unread}"
    assert "LAYERDIFF_INSECURE" not in names


def _deployed_commands() -> list[list[str]]:
    """Every `layerdiff ...` command line of the deployment, without `layerdiff`."""
    cmds = []
    for name in ("collector", "analyzer", "worker"):
        svc = compose()["services"][name]
        cmds.append(argv_of(svc))
        if svc["healthcheck"]["test"][1] == "layerdiff":
            cmds.append(svc["healthcheck"]["test"][2:])
    for w in workloads():
        for c in w["spec"]["template"]["spec"]["containers"]:
            if is_layerdiff(c):
                cmds.append(c["args"])
                cmds += [cmd[1:] for cmd in _probe_commands(c) if cmd[0] == "layerdiff"]
    return cmds


@pytest.mark.parametrize("argv", _deployed_commands(), ids=lambda a: " ".join(a))
def test_deployed_command_lines_parse(argv):
    """The images' entry point is `layerdiff`: a misspelt flag would crash-loop the container."""
    from layerdiff.client.cli import build_parser

    build_parser().parse_args(argv)


# ============================================================ images' inputs
def test_dockerignore_leaves_out_venv_git_and_secrets():
    ig = dockerignore()
    for path in (".venv", ".venv/bin/python", ".git", ".git/HEAD", "deploy/secrets", "deploy/secrets/ca.key",
                 "deploy/secrets/compose.env", "deploy/.env", "layerdiff.egg-info/PKG-INFO", "build/lib/x.py",
                 "demo-out/report.html", "bench-out/stream.json", ".hypothesis/examples/x", ".pytest_cache/x",
                 "services/analyzer/compare/__pycache__/metrics.cpython-311.pyc",
                 "proto/layerdiff/v1/layerdiff_pb2.py"):
        assert ig.excluded(path), f".dockerignore lets {path} into the build context"


def test_build_context_is_small():
    files = context_files()
    sizes = sorted(((ROOT / f).stat().st_size, f) for f in files)
    total = sum(s for s, _ in sizes)
    assert total < 8 * 2**20, f"build context {total / 2**20:.1f} MiB; largest: {sizes[-5:]}"
    assert not [f for f in files if re.search(r"(^|/)(\.venv|\.git|secrets)(/|$)|\.(key|pem|env)$", f)]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_copied_path_exists_and_reaches_the_build_context(dockerfile):
    ig = dockerignore()
    sources = context_sources(dockerfile)
    assert sources
    for src in sources:
        path = ROOT / src
        assert path.exists(), f"{dockerfile.name}: COPY {src}: no such path"
        assert not ig.excluded(src), f"{dockerfile.name}: COPY {src}: excluded by .dockerignore"
        if path.is_dir():
            for f in path.rglob("*"):
                rel = f.relative_to(ROOT).as_posix()
                if f.is_file() and ig.excluded(rel):
                    assert REGENERATED_OR_CACHE.search(rel), f"{rel} is under COPY {src} but not in the build context"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_pip_install_is_pinned(dockerfile):
    """Each install is bound by constraints.txt or installs without dependencies."""
    runs = [rest for ins, rest in dockerfile_instructions(dockerfile) if ins == "RUN"]
    installs = [seg for r in runs for seg in re.split(r"&&|;", r) if re.search(r"\bpip install\b", seg)]
    assert installs
    for seg in installs:
        assert re.search(r"(-c|--constraint)\s+\S*constraints\.txt", seg) or "--no-deps" in seg, seg


def test_constraints_pin_what_the_images_install():
    pins = constraints()
    assert {"grpcio", "pyarrow", "onnxruntime", "celery", "grpcio-tools", "protobuf"} <= set(pins)
    assert not {"pytest", "hypothesis", "kubernetes-validate", "onnxsim", "pytest-timeout"} & set(pins), \
        "test tools are not installed in any image"
    # the exact versions of this (tested) environment, for everything the images install
    done = subprocess.run([sys.executable, str(DEPLOY / "freeze-constraints.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr or done.stdout


def test_image_requirements_come_from_the_project():
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = arg_default(DOCKERFILE, "EXTRAS")
    out = subprocess.run([sys.executable, str(DEPLOY / "project-requirements.py"), str(ROOT / "pyproject.toml"),
                          extras], capture_output=True, text=True, check=True).stdout.split()
    assert out == project["dependencies"] + project["optional-dependencies"][extras]
    pins = constraints()
    assert not [r for r in out if canon(Requirement(r).name) not in pins], "unpinned image requirements"


def test_collector_image_leaves_the_analyzer_stack_out():
    pkgs = collector_packages()
    assert "onnxruntime" in pkgs and "pyarrow" in pkgs and "grpcio-health-checking" in pkgs
    closure = installed_closure(pkgs)
    assert not closure & {"tensorflow", "tensorflow-cpu", "keras", "celery", "kombu", "redis", "matplotlib",
                          "numba"}, sorted(closure)
    pins = constraints()
    assert not [p for p in pkgs if p not in pins], "the collector's packages are pinned too"


def test_importing_the_collector_loads_no_analyzer_stack():
    code = ("import sys, layerdiff.collector.service\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'celery', 'kombu', 'redis', 'tensorflow', 'keras', 'matplotlib', 'numba'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


# The collector image's Python: modules of any distribution it does not
# install cannot be imported. The collector starts, its probe runs, and the
# paths it takes only on demand (FP16 and INT8 conversion, HDF5 dumps,
# collector-side commands) import.
_COLLECTOR_IMAGE_PROBE = r"""
import importlib.abc, importlib.metadata as md, json, re, sys
allowed = set(json.loads(sys.argv[1]))
canon = lambda n: re.sub(r"[-_.]+", "-", n).lower()
blocked = {m for m, dists in md.packages_distributions().items()
           if not any(canon(d) in allowed for d in dists)} - {"layerdiff"}

class NotInImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (not in the collector image)", name=name)

sys.meta_path.insert(0, NotInImage())
import layerdiff.collector.service, layerdiff.client.cli, layerdiff.client.health
import layerdiff.collector.dumps.config, layerdiff.collector.dumps.convert, layerdiff.collector.dumps.overflow
from onnxruntime.transformers.float16 import convert_float_to_float16
from onnxruntime.quantization import quantize_static
import h5py
from layerdiff.collector.service import CollectorServer
from layerdiff.client.cli import main
with CollectorServer() as server:
    assert main(["health", server.address, "--timeout", "10"]) == 0
print("collector image ok")
"""


def test_collector_runs_with_only_its_image_packages(tmp_path):
    allowed = sorted(installed_closure(collector_packages()))
    done = subprocess.run([sys.executable, "-c", _COLLECTOR_IMAGE_PROBE, json.dumps(allowed)], capture_output=True,
                          text=True, cwd=tmp_path, env=base_env(), timeout=120)
    assert done.returncode == 0 and "collector image ok" in done.stdout, done.stderr[-3000:]


def test_wheel_builds_from_the_build_context(tmp_path):
    """What the images' build stage does: stubs generated, then the wheel, from the context alone."""
    ctx = tmp_path / "context"
    for rel in context_files():
        (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, ctx / rel, follow_symlinks=False)
    assert not list((ctx / "proto").rglob("*_pb2.py")), "stubs must come from the build, not the context"
    subprocess.run([str(ctx / "proto" / "generate.sh"), sys.executable], check=True, capture_output=True)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "wheels"), str(ctx)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = (tmp_path / "wheels").glob("layerdiff-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    source = (ROOT / "src" / "layerdiff").resolve()     # services/, where layerdiff's modules are
    for module in source.rglob("*.py"):                 # every module of every folder, subpackages included
        inside = module.relative_to(source).as_posix()
        if not REGENERATED_OR_CACHE.search(inside):
            assert f"layerdiff/{inside}" in names, f"{module} is not in the wheel"
    assert {"layerdiff/v1/layerdiff_pb2.py", "layerdiff/v1/layerdiff_pb2_grpc.py",
            "layerdiff/vendor/ascend_dump_pb2.py"} <= names
    entry_points = next(zipfile.ZipFile(wheel).read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert re.search(r"^layerdiff\s*=\s*layerdiff\.client\.cli:main$", entry_points, re.M)


# ===================================================== live, on loopback
@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory) -> Path:
    if not shutil.which("openssl"):
        pytest.skip("openssl is needed to issue the deployment's certificates")
    out = tmp_path_factory.mktemp("deploy") / "secrets"
    subprocess.run([str(DEPLOY / "make-secrets.sh"), str(out)], check=True, capture_output=True,
                   env={**base_env(), "NAMESPACE": "layerdiff"})
    return out


def _openssl(*args: str) -> str:
    return subprocess.run(["openssl", *args], check=True, capture_output=True, text=True).stdout


def test_make_secrets_issues_what_the_deployment_expects(secrets_dir):
    s = secrets_dir
    assert stat.S_IMODE(s.stat().st_mode) == 0o700 and stat.S_IMODE((s / "ca.key").stat().st_mode) == 0o600
    for name in ("redis", "analyzer", "collector", "worker", "client"):
        assert _openssl("verify", "-CAfile", str(s / "ca.pem"), str(s / f"{name}.crt")).strip().endswith("OK")
        ext = _openssl("x509", "-in", str(s / f"{name}.crt"), "-noout", "-ext", "subjectAltName,extendedKeyUsage")
        if name in ("redis", "analyzer", "collector"):
            for san in (f"DNS:{name}", f"DNS:{name}.layerdiff.svc", "IP Address:127.0.0.1"):
                assert san in ext, f"{name}.crt lacks {san}"
        if name != "redis":    # presented as client certificates (mutual TLS)
            assert "Client Authentication" in ext, name
    service = (s / "service.token").read_text().split()
    accepted = [ln for ln in (s / "analyzer.tokens").read_text().splitlines() if ln and not ln.startswith("#")]
    assert len(service) == 1 and accepted[0] == service[0], "the analyzer sends the first token to collectors"
    assert "admin:" + (s / "client.token").read_text().strip() in accepted
    assert all(len(t) >= 16 for t in service + [(s / "task_secret").read_text().strip()])
    assert re.fullmatch(r"REDIS_PASSWORD=[0-9a-f]{64}\n", (s / "compose.env").read_text())
    again = subprocess.run([str(DEPLOY / "make-secrets.sh"), str(s)], capture_output=True, text=True)
    assert again.returncode != 0 and "not overwriting" in again.stderr


@dataclass
class Redis:
    port: int
    password: str
    proc: subprocess.Popen


def _start_redis(script: str, password: str, cwd: Path) -> Redis | subprocess.CompletedProcess:
    port = free_port()
    env = {**base_env(), "REDIS_PASSWORD": password}
    script = re.sub(r"--tls-port \d+", f"--tls-port {port}", script)
    proc = subprocess.Popen(["sh", "-c", script], env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    end = time.monotonic() + 10
    while time.monotonic() < end:
        if proc.poll() is not None:
            return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.read(), "")
        with socket.socket() as so:
            if so.connect_ex(("127.0.0.1", port)) == 0:
                return Redis(port, password, proc)
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("redis did not start")


def _compose_redis_script(secrets: Path) -> str:
    redis = interpolate(compose()["services"]["redis"], {"REDIS_PASSWORD": "x" * 16})
    argv = argv_of(redis)
    assert argv[:2] == ["sh", "-c"]
    return argv[2].replace("/run/secrets/", f"{secrets}/")


def _k8s_redis_script(secrets: Path) -> str:
    c = workload("redis")["spec"]["template"]["spec"]["containers"][0]
    assert c["command"][:2] == ["sh", "-c"]
    files = {"/tls/tls.crt": "redis.crt", "/tls/tls.key": "redis.key", "/tls/ca.crt": "ca.pem"}
    script = c["command"][2]
    for path, name in files.items():
        script = script.replace(path, str(secrets / name))
    return script


@pytest.fixture(scope="module")
def redis_server(secrets_dir, tmp_path_factory):
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed (make setup installs it)")
    password = (secrets_dir / "compose.env").read_text().strip().split("=", 1)[1]
    r = _start_redis(_compose_redis_script(secrets_dir), password, tmp_path_factory.mktemp("redis"))
    assert isinstance(r, Redis), r.stdout
    yield r
    r.proc.terminate()
    r.proc.wait(10)


def test_redis_serves_tls_only_and_wants_the_password(redis_server, secrets_dir):
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    tls = {"host": "localhost", "port": redis_server.port, "ssl": True, "ssl_cert_reqs": "required",
           "ssl_ca_certs": str(secrets_dir / "ca.pem"), "socket_timeout": 5, "retry": Retry(NoBackoff(), 0)}
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(**tls).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(**tls, password="not-the-password").ping()
    assert redis.Redis(**tls, password=redis_server.password).ping()
    # plain text gets no answer: the port speaks TLS only (and --port 0 opened no other)
    with socket.create_connection(("127.0.0.1", redis_server.port), timeout=5) as plain:
        plain.sendall(b"*1\r\n$4\r\nPING\r\n")
        try:
            answer = plain.recv(64)
        except (TimeoutError, ConnectionResetError):
            answer = b""
    assert not answer.startswith((b"+PONG", b"-NOAUTH")), answer


def test_compose_redis_healthcheck_passes(redis_server, secrets_dir):
    if not shutil.which("redis-cli"):
        pytest.skip("redis-cli is not installed")
    test = interpolate(compose()["services"]["redis"]["healthcheck"]["test"], {})
    assert test[0] == "CMD-SHELL"
    cmd = test[1].replace("/run/secrets/", f"{secrets_dir}/").replace("-p 6380", f"-p {redis_server.port}")
    env = {**base_env(), "REDIS_PASSWORD": redis_server.password}
    assert subprocess.run(["sh", "-c", cmd], env=env, timeout=20).returncode == 0
    assert subprocess.run(["sh", "-c", cmd], env={**env, "REDIS_PASSWORD": "wrong" * 4}, timeout=20).returncode != 0


@pytest.mark.parametrize("flavor", ["compose", "k8s"])
def test_redis_refuses_a_short_password(flavor, secrets_dir, tmp_path):
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed")
    script = (_compose_redis_script if flavor == "compose" else _k8s_redis_script)(secrets_dir)
    done = _start_redis(script, "REPLACE-ME", tmp_path)
    if isinstance(done, Redis):
        done.proc.kill()
        pytest.fail("redis started with the placeholder password")
    assert done.returncode != 0 and "16 characters" in done.stdout


def test_k8s_redis_command_and_probe(secrets_dir, tmp_path):
    if not (shutil.which("redis-server") and shutil.which("redis-cli")):
        pytest.skip("redis-server and redis-cli are needed")
    r = _start_redis(_k8s_redis_script(secrets_dir), "a" * 32, tmp_path)
    assert isinstance(r, Redis), r.stdout
    try:
        c = workload("redis")["spec"]["template"]["spec"]["containers"][0]
        probe = c["readinessProbe"]["exec"]["command"]
        cmd = probe[2].replace("/tls/ca.crt", str(secrets_dir / "ca.pem")).replace("-p 6380", f"-p {r.port}")
        env = {**base_env(), "REDISCLI_AUTH": r.password}
        assert subprocess.run(probe[:2] + [cmd], env=env, timeout=20).returncode == 0
        assert subprocess.run(probe[:2] + [cmd], env={**env, "REDISCLI_AUTH": "b" * 32}, timeout=20).returncode != 0
    finally:
        r.proc.terminate()
        r.proc.wait(10)


# ------------------------------------------- services with the deployment's settings
# The files behind each mounted Secret key, as deploy/make-secrets.sh names them.
K8S_SECRET_FILES = {
    **{(f"{n}-tls", k): f for n in ("redis", "analyzer", "worker", "collector")
       for k, f in (("tls.crt", f"{n}.crt"), ("tls.key", f"{n}.key"), ("ca.crt", "ca.pem"))},
    ("layerdiff-tokens", "analyzer.tokens"): "analyzer.tokens",
    ("layerdiff-tokens", "service.token"): "service.token",
    ("layerdiff-service-token", "service.token"): "service.token",
    ("layerdiff-task-secret", "task_secret"): "task_secret",
}


@dataclass
class Deployed:
    argv: list[str]            # after `layerdiff`
    env: dict
    probe: list[str]           # the health command, after `layerdiff`


def _localize(value: str, files: dict[str, Path], redis: Redis, dumps: Path) -> str:
    for path in sorted(files, key=len, reverse=True):
        value = value.replace(path, str(files[path]))
    value = re.sub(r"@redis(\.layerdiff\.svc)?:6380/", f"@localhost:{redis.port}/", value)
    return value.replace("/var/lib/layerdiff/dumps", str(dumps))


def deployed(flavor: str, name: str, secrets: Path, redis: Redis, work: Path) -> Deployed:
    """A service's command line, environment and probe as the deployment gives
    them, with paths, hosts and ports made local: certificates from
    make-secrets.sh, Redis on loopback, free ports."""
    dumps = work / "dumps"
    dumps.mkdir(parents=True, exist_ok=True)
    if flavor == "compose":
        svc = interpolate(compose()["services"][name], {"REDIS_PASSWORD": redis.password})
        argv, env, probe = argv_of(svc), dict(svc.get("environment") or {}), svc["healthcheck"]["test"][2:]
        files = {f"/run/secrets/{p.name}": p for p in secrets.iterdir()}
    else:
        c = workload(name)["spec"]["template"]["spec"]["containers"][0]
        pod = workload(name)["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        files = {}
        for m in c.get("volumeMounts", []):
            sv = volumes[m["name"]].get("secret")
            if sv:
                for (secret, key), file in K8S_SECRET_FILES.items():
                    items = {it["key"]: it["path"] for it in sv.get("items", [])} or None
                    if secret == sv["secretName"] and (items is None or key in items):
                        files[f"{m['mountPath']}/{(items or {}).get(key, key)}"] = secrets / file
        argv, env = list(c["args"]), {}
        for e in c["env"]:
            if "valueFrom" in e:
                ref = e["valueFrom"]["secretKeyRef"]
                assert (ref["name"], ref["key"]) == ("redis-auth", "password")
                env[e["name"]] = redis.password
            else:       # Kubernetes expands $(VAR) from the variables before it
                env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), e["value"])
        probe = c["readinessProbe"]["exec"]["command"][1:]
    ports = {}
    if "--port" in argv:
        ports[option(argv, "--port")] = str(free_port())
        argv[argv.index("--port") + 1] = ports[option(argv, "--port")]
        argv[argv.index("--workdir") + 1] = str(work / "state")
    if "LAYERDIFF_TENSOR_PORT" in env:
        env["LAYERDIFF_TENSOR_PORT"] = str(free_port())
    env = {k: _localize(str(v), files, redis, dumps) for k, v in env.items()}
    left = [f"{k}={v}" for k, v in env.items() if re.search(r"/run/secrets/|/etc/layerdiff/", v)]
    assert not left, f"{flavor} {name}: settings pointing at files no Secret provides: {left}"
    probe = [re.sub(r"127\.0\.0\.1:(\d+)", lambda m: f"127.0.0.1:{ports.get(m.group(1), m.group(1))}", a)
             for a in probe]
    return Deployed(argv, env, probe)


class Service:
    def __init__(self, d: Deployed, cwd: Path) -> None:
        cwd.mkdir(parents=True, exist_ok=True)
        self.log = open(cwd / "service.log", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "layerdiff.client.cli", *d.argv], cwd=cwd,
                                     env={**base_env(), **d.env}, stdout=subprocess.PIPE, stderr=self.log, text=True)

    def wait_listening(self, timeout: float = 60.0) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if "listening on" not in line:
            self.log.seek(0)
            raise AssertionError(f"did not start: {line!r}\n{self.log.read()[-3000:]}")
        return line

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()


def _health(d: Deployed, env: dict, timeout: float = 60.0) -> int:
    """The deployment's probe, repeated until it passes or ``timeout`` ends; its last status."""
    end = time.monotonic() + timeout
    while True:
        rc = subprocess.run([sys.executable, "-m", "layerdiff.client.cli", *d.probe, "--timeout", "5"],
                            env={**base_env(), **env}, capture_output=True, text=True, timeout=60).returncode
        if rc == 0 or time.monotonic() > end:
            return rc
        time.sleep(0.5)


@pytest.mark.parametrize("flavor", ["compose", "k8s"])
@pytest.mark.parametrize("name", ["collector", "analyzer"])
def test_service_serves_with_the_deployment_settings_and_passes_its_probe(flavor, name, secrets_dir, redis_server,
                                                                           tmp_path):
    d = deployed(flavor, name, secrets_dir, redis_server, tmp_path)
    assert d.argv[d.argv.index("--host") + 1] == "0.0.0.0", "served beyond loopback: TLS and tokens are enforced"
    service = Service(d, tmp_path / "run")
    try:
        service.wait_listening()
        assert _health(d, d.env) == 0, "the configured probe does not pass"
        # mutual TLS is enforced: without a client certificate the probe is turned away
        no_cert = {k: v for k, v in d.env.items() if k not in ("LAYERDIFF_TLS_CERT", "LAYERDIFF_TLS_KEY")}
        assert _health(d, no_cert, timeout=0) == 3
        if name == "collector":     # and the collector wants its token
            no_token = {k: v for k, v in d.env.items() if k != "LAYERDIFF_TOKEN_FILE"}
            assert _health(d, no_token, timeout=0) == 3
    finally:
        service.stop()


def test_worker_answers_its_probe(secrets_dir, redis_server, tmp_path):
    d = deployed("compose", "worker", secrets_dir, redis_server, tmp_path)
    d.argv[d.argv.index("--max-cores") + 1] = "1"
    probe = [sys.executable, str(DEPLOY / "worker-health"), "2"]
    env = {**base_env(), **d.env}
    assert subprocess.run(probe, env=env, capture_output=True, timeout=60).returncode == 1, "no worker yet"
    service = Service(d, tmp_path / "run")
    try:
        end, rc = time.monotonic() + 45, None
        while time.monotonic() < end and rc != 0:
            rc = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=60).returncode
            assert service.proc.poll() is None, (tmp_path / "run" / "service.log").read_text()[-3000:]
        assert rc == 0, "the worker never answered its probe"
        wrong = env["LAYERDIFF_BROKER_URL"].replace(f":{redis_server.password}@", ":not-the-password@")
        assert subprocess.run(probe, env={**env, "LAYERDIFF_BROKER_URL": wrong}, capture_output=True,
                              timeout=60).returncode == 3
    finally:
        service.stop()
