"""deploy/: every manifest parses, and the references between them agree with each other
and with the code (images, ports, env names, service names, rrl commands and options).

Kubernetes, Docker and the Ray cluster launcher cannot run here, so this checks shapes:
what the manifests say against what the code reads. The facts about the code come from
the code itself (the typer app, the source of the modules, pyproject.toml, the Makefile,
Ray's own schema and constants, `etcd --help`), so a rename on either side fails here.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import time
import tomllib
from collections.abc import Iterator
from functools import cache
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import typer.main
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
ETCD = DEPLOY / "etcd"
RAY_CLUSTER = DEPLOY / "ray" / "cluster.yaml"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
DOCS = ROOT / "docs" / "deploy.md"
IMAGE = "resilient-rl"
CODE_DIRS = ("resilient_rl", "controller", "checkpoints")
ETCD_CLIENT_PORT, ETCD_PEER_PORT = 2379, 2380  # etcd's registered ports


# --- facts about the code -------------------------------------------------------


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@cache
def _rrl() -> Any:
    """The click command tree of `rrl` (typer builds it; recent typer ships its own click,
    so groups and options are recognised by shape, not by click's classes)."""
    from resilient_rl.cli import app

    cmd = typer.main.get_command(app)
    assert _is_group(cmd)
    return cmd


def _is_group(cmd: Any) -> bool:
    return isinstance(getattr(cmd, "commands", None), dict)


def _options(cmd: Any) -> list[Any]:
    return [p for p in cmd.params if getattr(p, "param_type_name", "") == "option"]


def _all_commands(group: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for name, cmd in group.commands.items():
        yield (*path, name), cmd
        if _is_group(cmd):
            yield from _all_commands(cmd, (*path, name))


@cache
def _code_env_vars() -> set[str]:
    """Every environment variable the code reads: typer/click options' envvars plus
    ``os.environ[...]`` / ``os.environ.get(...)`` / ``os.getenv(...)`` in the sources."""
    names: set[str] = set()
    for _, cmd in _all_commands(_rrl()):
        for p in cmd.params:
            ev = getattr(p, "envvar", None)
            names.update([ev] if isinstance(ev, str) else (ev or []))
    pattern = re.compile(r"""(?:environ(?:\.get|\.setdefault)?\s*[\[(]|getenv\s*\()\s*["']([A-Z][A-Z0-9_]*)["']""")
    constant = re.compile(r"""^\w*ENV\w* = ["']([A-Z][A-Z0-9_]*)["']""", re.M)  # ENV_CA = "RRL_ETCD_CA"
    for d in CODE_DIRS:
        for f in (ROOT / d).rglob("*.py"):
            text = f.read_text()
            names.update(pattern.findall(text), constant.findall(text))
    return names


def _controller_option(name: str) -> Any:
    return next(p for p in _options(_rrl().commands["controller"]) if name in p.opts)


def _documented_api_port() -> int:
    """The controller port the code documents (the --api help's example URL)."""
    api = next(p for p in _options(_rrl().commands["status"]) if "--api" in p.opts)
    m = re.search(r"http://[\w.]+:(\d+)", api.help or "")
    assert m, f"--api help names no example URL: {api.help!r}"
    return int(m.group(1))


def _ray_gcs_default_port() -> int:
    spec = find_spec("ray")
    assert spec and spec.submodule_search_locations
    src = (Path(next(iter(spec.submodule_search_locations))) / "_private" / "ray_constants.py").read_text()
    m = re.search(r"^DEFAULT_PORT = (\d+)$", src, re.M)
    assert m, "ray_constants.DEFAULT_PORT not found"
    return int(m.group(1))


@cache
def _etcd_flags() -> set[str]:
    out = subprocess.run(["etcd", "--help"], capture_output=True, text=True, timeout=30)
    flags = set(re.findall(r"^\s+--([a-z0-9-]+)", out.stdout + out.stderr, re.M))
    assert len(flags) > 40, "could not read etcd's flags from `etcd --help`"
    return flags


# --- the manifests ---------------------------------------------------------------


@cache
def _k8s_docs() -> list[dict[str, Any]]:
    docs = []
    for f in sorted(K8S.glob("*.yaml")):
        if f.name != "kustomization.yaml":
            docs += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return docs


def _one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in _k8s_docs() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''} in deploy/k8s, found {len(found)}"
    return found[0]


def _pod_specs() -> dict[str, dict[str, Any]]:
    """Every pod template in deploy/k8s, by a readable name."""
    out = {}
    for d in _k8s_docs():
        name = f"{d['kind']}/{d['metadata']['name']}"
        if d["kind"] in ("Deployment", "StatefulSet"):
            out[name] = d["spec"]["template"]["spec"]
        elif d["kind"] == "RayCluster":
            out[f"{name}/head"] = d["spec"]["headGroupSpec"]["template"]["spec"]
            for g in d["spec"]["workerGroupSpecs"]:
                out[f"{name}/{g['groupName']}"] = g["template"]["spec"]
    return out


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def _controller_container() -> dict[str, Any]:
    spec = _one("Deployment", "rrl-controller")["spec"]["template"]["spec"]
    return next(c for c in spec["containers"] if c["name"] == "controller")


def _env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


def _dockerfile_tags() -> dict[str, str]:
    """``{target: tag}`` from the Dockerfile's documented build commands."""
    text = DOCKERFILE.read_text()
    tags = dict(re.findall(rf"--target (\w+) -t ({IMAGE}:[\w.-]+)", text))
    assert tags, "the Dockerfile documents no `docker build --target X -t resilient-rl:TAG` command"
    return tags


def _shell_texts() -> dict[str, str]:
    """Every piece of shell in deploy/ and docs/deploy.md that may run `rrl`, by source."""
    texts: dict[str, str] = {}
    for name, spec in _pod_specs().items():
        for c in spec.get("containers", []):
            texts[f"{name}/{c['name']}"] = "\n".join([*c.get("command", []), *c.get("args", [])])
    ray = yaml.safe_load(RAY_CLUSTER.read_text())
    cmds = [v for k, v in ray.items() if k.endswith("_commands")]
    cmds += [t.get("worker_setup_commands", []) for t in ray["available_node_types"].values()]
    texts["deploy/ray/cluster.yaml"] = "\n".join(c for group in cmds for c in group)
    texts["deploy/etcd/start-member.sh"] = (ETCD / "start-member.sh").read_text()
    texts["deploy/docker/Dockerfile"] = "\n".join(
        " ".join(json.loads(m)) for m in re.findall(r"^(?:CMD|ENTRYPOINT) (\[.*\])$", DOCKERFILE.read_text(), re.M)
    )
    blocks = re.findall(r"```(?:bash|sh|console)\n(.*?)```", DOCS.read_text(), re.S)
    texts["docs/deploy.md"] = "\n".join(blocks)
    return texts


def _rrl_invocations(text: str) -> Iterator[list[str]]:
    """The argument lists of every `rrl ...` command in a piece of shell: `rrl` (or
    `.../bin/rrl`) where a command starts (line start, after an operator, after
    exec/nohup/sudo/`--`, after an rrl image name); quoted strings are searched too
    (`ray exec CONFIG 'rrl status'`)."""
    ops = set(";&|<>()")
    text = text.replace("\\\n", " ")
    for line in text.splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|<>()")
        lex.whitespace_split = True
        lex.commenters = "#"
        try:
            tokens = list(lex)
        except ValueError:  # an unbalanced quote: not a command line
            continue
        for i, tok in enumerate(tokens):
            if " " in tok:
                yield from _rrl_invocations(tok)
                continue
            prev = tokens[i - 1] if i else ";"
            starts = set(prev) <= ops or prev in ("exec", "nohup", "sudo", "--") or prev.startswith(f"{IMAGE}:")
            if starts and (tok == "rrl" or tok.endswith("/bin/rrl")):
                args = []
                for t in tokens[i + 1 :]:
                    if t and set(t) <= ops:
                        break
                    args.append(t)
                yield args


# --- the tests ----------------------------------------------------------------------


def test_every_manifest_parses_and_kustomization_lists_them() -> None:
    for f in [*K8S.glob("*.yaml"), RAY_CLUSTER]:
        docs = [d for d in yaml.safe_load_all(f.read_text()) if d is not None]
        assert docs, f"{f} is empty"
        for d in docs:
            assert isinstance(d, dict), f"{f}: a document that is not a mapping"
    kz = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = kz["resources"]
    for r in listed:
        assert (K8S / r).is_file(), f"kustomization.yaml lists {r}, which does not exist"
    unlisted = {f.name for f in K8S.glob("*.yaml")} - set(listed) - {"kustomization.yaml"}
    assert not unlisted, f"deploy/k8s files not in kustomization.yaml: {sorted(unlisted)}"
    for d in _k8s_docs():
        assert "namespace" not in d["metadata"], "the namespace comes from kustomization.yaml"
    assert kz["namespace"] == _one("Namespace")["metadata"]["name"]
    assert [i["name"] for i in kz["images"]] == [IMAGE]
    for f in ETCD.glob("*.env"):
        assert _env_file(f), f"{f} sets nothing"
    assert os.access(ETCD / "start-member.sh", os.X_OK), "deploy/etcd/start-member.sh must be executable"


def test_images_are_the_dockerfile_tags() -> None:
    tags = _dockerfile_tags()
    version = _pyproject()["project"]["version"]
    assert tags == {"cpu": f"{IMAGE}:{version}-cpu", "gpu": f"{IMAGE}:{version}-gpu"}
    stages = re.findall(r"^FROM \S+ AS (\w+)$", DOCKERFILE.read_text(), re.M)
    assert set(tags) <= set(stages), f"documented targets {sorted(tags)} vs Dockerfile stages {stages}"
    for name, spec in _pod_specs().items():
        for c in spec["containers"]:
            if c["image"].split(":")[0].endswith(IMAGE):
                gpu = "nvidia.com/gpu" in c.get("resources", {}).get("limits", {})
                assert c["image"] == tags["gpu" if gpu else "cpu"], f"{name}: image {c['image']}"
            else:
                assert name.startswith("StatefulSet/etcd"), f"{name} runs {c['image']}, not an rrl image"
    assert _one("StatefulSet", "etcd")  # the only pod on another image
    # the Ray launcher config names images only in its (commented) docker variant
    for ref in re.findall(rf"\S*{IMAGE}:[\w.-]+", RAY_CLUSTER.read_text()):
        assert ref.split("/")[-1] in tags.values(), f"deploy/ray/cluster.yaml names {ref}"
    for ref in re.findall(rf"(?<![\w/.-]){IMAGE}:[\w.-]+", DOCS.read_text()):
        assert ref in tags.values(), f"docs/deploy.md names image {ref}"


def test_dockerfile_variants_install_the_project_extras() -> None:
    text = DOCKERFILE.read_text()
    stages = dict(re.findall(r"^FROM \S+ AS (\w+)\n(.*?)(?=^FROM |\Z)", text, re.M | re.S))
    extras = _pyproject()["project"]["optional-dependencies"]
    for variant in ("cpu", "gpu"):
        assert variant in extras
        assert f'pip install -e ".[{variant}]"' in stages[variant], f"the {variant} stage must install .[{variant}]"
    # the CPU image removes exactly what `make` removes after its CPU install
    make = re.search(r"pip uninstall -y -q ([\w ]+)", (ROOT / "Makefile").read_text())
    assert make
    docker = re.search(r"pip uninstall -y ([\w ]+)", stages["cpu"])
    assert docker and docker.group(1).split() == make.group(1).split()
    assert "uninstall" not in stages["gpu"], "upstream vLLM needs its torchvision"
    # EXPOSE names the controller's port and Ray's GCS port
    exposed = {int(p) for p in re.search(r"^EXPOSE ([\d ]+)$", text, re.M).group(1).split()}  # type: ignore[union-attr]
    assert {_documented_api_port(), _ray_gcs_default_port()} <= exposed


def test_ray_versions_and_cluster_launcher_schema() -> None:
    pin = next(d for d in _pyproject()["project"]["dependencies"] if d.startswith("ray=="))
    version = pin.split("==")[1]
    assert _one("RayCluster")["spec"]["rayVersion"] == version
    spec = find_spec("ray")
    assert spec and spec.submodule_search_locations
    schema_path = Path(next(iter(spec.submodule_search_locations))) / "autoscaler" / "ray-schema.json"
    config = yaml.safe_load(RAY_CLUSTER.read_text())
    jsonschema.validate(config, json.loads(schema_path.read_text()))
    assert config["head_node_type"] in config["available_node_types"]
    gpu_types = [t for t in config["available_node_types"].values() if t["resources"].get("GPU")]
    assert gpu_types and all('[gpu]"' in " ".join(t["worker_setup_commands"]) for t in gpu_types)
    assert '[cpu]"' in " ".join(config["setup_commands"])


def test_ports_agree_with_each_other_and_the_code() -> None:
    gcs = _ray_gcs_default_port()
    api_port = _documented_api_port()
    # the code's defaults that make explicit flags necessary in a cluster
    assert _controller_option("--http-port").default == 0, "the controller port default changed: update deploy/"
    assert _controller_option("--http-host").default == "127.0.0.1"

    # etcd: flags, container ports, the headless Service
    sts = _one("StatefulSet", "etcd")
    c = sts["spec"]["template"]["spec"]["containers"][0]
    flags = dict(a[2:].split("=", 1) for a in c["command"][1:])
    assert flags["listen-client-urls"].endswith(f":{ETCD_CLIENT_PORT}")
    assert flags["listen-peer-urls"].endswith(f":{ETCD_PEER_PORT}")
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"client": ETCD_CLIENT_PORT, "peer": ETCD_PEER_PORT}
    svc = _one("Service", sts["spec"]["serviceName"])
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"client": ETCD_CLIENT_PORT, "peer": ETCD_PEER_PORT}
    # the bare-metal cluster
    cluster = _env_file(ETCD / "cluster.env")
    assert cluster["ETCD_LISTEN_CLIENT_URLS"].endswith(f":{ETCD_CLIENT_PORT}")
    assert cluster["ETCD_LISTEN_PEER_URLS"].endswith(f":{ETCD_PEER_PORT}")

    # the controller: the flag, the container port, the Service, the probes
    ctl = _controller_container()
    args = next(iter(_rrl_invocations("\n".join(ctl["command"]))))
    assert args[args.index("--http-port") + 1] == str(api_port)
    assert args[args.index("--http-host") + 1] == "0.0.0.0", "on loopback the Service could not reach it"
    assert {p["name"]: p["containerPort"] for p in ctl["ports"]} == {"http": api_port}
    csvc = _one("Service", "rrl-controller")
    assert csvc["spec"]["ports"] == [{"name": "http", "port": api_port, "targetPort": "http"}]
    assert (
        csvc["spec"]["selector"].items()
        <= _one("Deployment", "rrl-controller")["spec"]["template"]["metadata"]["labels"].items()
    )
    head = _pod_specs()["RayCluster/rrl-ray/head"]["containers"][0]
    assert _env(head)["RRL_API"] == f"http://{csvc['metadata']['name']}:{api_port}"

    # Ray: the GCS port the controllers join through, on the KubeRay head Service
    ray_name = _one("RayCluster")["metadata"]["name"]
    assert _env(ctl)["RAY_ADDRESS"] == f"{ray_name}-head-svc:{gcs}"
    assert {"name": "gcs-server", "containerPort": gcs} in head["ports"]
    launcher = yaml.safe_load(RAY_CLUSTER.read_text())
    assert any(f"ray start --head --port={gcs}" in cmd for cmd in launcher["head_start_ray_commands"])
    assert all(f":{gcs}" in cmd for cmd in launcher["worker_start_ray_commands"] if "ray start" in cmd)
    ports = [inv[inv.index("--http-port") + 1] for inv in _rrl_invocations(_shell_texts()["deploy/ray/cluster.yaml"])]
    assert ports and ports[0] == str(api_port) and len(set(ports)) == len(ports), f"controller ports {ports}"


def test_env_vars_are_ones_the_code_reads() -> None:
    code = _code_env_vars()
    # the ones the deployments rely on; if the code stops reading one, its manifest is wrong
    for needed in ("RRL_ETCD", "RAY_ADDRESS", "RRL_HOME", "RRL_TOKEN", "RRL_API"):
        assert needed in code, f"the code no longer reads {needed}; deploy/ and docs/deploy.md use it"

    used: dict[str, str] = {}
    for name, spec in _pod_specs().items():
        for c in spec["containers"]:
            for var in _env(c):
                used[var] = name
    for name, text in _shell_texts().items():
        for var in re.findall(r"\b(RRL_[A-Z0-9_]+|RAY_ADDRESS)\b", text):
            used.setdefault(var, name)
    used.setdefault("RRL_HOME", "deploy/ray/cluster.yaml")
    for var, where in sorted(used.items()):
        if var.startswith("RRL_") or var == "RAY_ADDRESS":
            assert var in code, f"{where} sets {var}, which the code never reads"
    ctl = _env(_controller_container())
    assert {"RRL_ETCD", "RAY_ADDRESS", "RRL_HOME", "RRL_TOKEN"} <= ctl.keys()
    assert "RRL_ETCD=" in _shell_texts()["deploy/ray/cluster.yaml"]
    # every ETCD_* setting is an etcd flag (etcd warns about, and ignores, unknown ones)
    flags = _etcd_flags()
    for f in ETCD.glob("*.env"):
        for key in _env_file(f):
            assert key.startswith("ETCD_") and key[5:].lower().replace("_", "-") in flags, f"{f.name}: {key}"
    sts = _one("StatefulSet", "etcd")["spec"]["template"]["spec"]["containers"][0]
    for arg in sts["command"][1:]:
        assert arg[2:].split("=")[0] in flags, f"deploy/k8s/etcd.yaml: etcd has no flag {arg}"


def test_etcd_endpoints_name_every_member() -> None:
    sts = _one("StatefulSet", "etcd")
    svc = _one("Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    n = sts["spec"]["replicas"]
    assert n == 3
    members = [f"{sts['metadata']['name']}-{i}" for i in range(n)]
    for name, spec in _pod_specs().items():
        for c in spec["containers"]:
            value = _env(c).get("RRL_ETCD")
            if value is None:
                continue
            hosts = [ep.rsplit(":", 1) for ep in value.split(",")]
            assert [h.split(".")[:2] for h, _ in hosts] == [[m, svc["metadata"]["name"]] for m in members], name
            assert {p for _, p in hosts} == {str(ETCD_CLIENT_PORT)}, name
    # the members' own view: initial-cluster lists each pod under the headless Service
    c = sts["spec"]["template"]["spec"]["containers"][0]
    flags = dict(a[2:].split("=", 1) for a in c["command"][1:])
    initial = dict(m.split("=", 1) for m in flags["initial-cluster"].split(","))
    assert list(initial) == members
    for m, url in initial.items():
        assert url.startswith(f"http://{m}.{svc['metadata']['name']}.") and url.endswith(f":{ETCD_PEER_PORT}")
    assert flags["initial-advertise-peer-urls"] == initial["etcd-0"].replace("etcd-0", "$(POD_NAME)")

    # the bare-metal cluster: cluster.env's members are the NAME.env files, and the
    # Ray launcher's RRL_ETCD names each of them on the client port
    cluster = _env_file(ETCD / "cluster.env")
    initial = dict(m.split("=", 1) for m in cluster["ETCD_INITIAL_CLUSTER"].split(","))
    assert sorted(initial) == sorted(f.stem for f in ETCD.glob("*.env") if f.stem not in ("cluster", "tls"))
    client_hosts = []
    for name, peer in initial.items():
        member = _env_file(ETCD / f"{name}.env")
        assert member["ETCD_NAME"] == name
        assert member["ETCD_INITIAL_ADVERTISE_PEER_URLS"] == peer and peer.endswith(f":{ETCD_PEER_PORT}")
        assert member["ETCD_ADVERTISE_CLIENT_URLS"] == peer.replace(f":{ETCD_PEER_PORT}", f":{ETCD_CLIENT_PORT}")
        client_hosts.append(member["ETCD_ADVERTISE_CLIENT_URLS"].removeprefix("http://"))
    m = re.search(r"RRL_ETCD=([\w.:,-]+)", RAY_CLUSTER.read_text())
    assert m and m.group(1).split(",") == client_hosts


def test_shared_volume_is_mounted_at_rrl_home_everywhere() -> None:
    pvc = _one("PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"], "controllers and Ray pods on many nodes share it"
    mounts = {}
    for name, spec in _pod_specs().items():
        if name.startswith("StatefulSet/etcd"):
            continue
        vols = {
            v["name"]
            for v in spec["volumes"]
            if v.get("persistentVolumeClaim", {}).get("claimName") == pvc["metadata"]["name"]
        }
        assert len(vols) == 1, f"{name} does not mount the {pvc['metadata']['name']} volume"
        for c in spec["containers"]:
            paths = [m["mountPath"] for m in c.get("volumeMounts", []) if m["name"] in vols]
            assert len(paths) == 1, f"{name}/{c['name']} does not mount it"
            assert _env(c).get("RRL_HOME") == paths[0], f"{name}/{c['name']}: RRL_HOME is not the shared volume"
            mounts[f"{name}/{c['name']}"] = paths[0]
    assert any(k.startswith("Deployment/rrl-controller") for k in mounts)
    assert sum(k.startswith("RayCluster/") for k in mounts) == 1 + len(_one("RayCluster")["spec"]["workerGroupSpecs"])
    assert len(set(mounts.values())) == 1, f"mount paths differ: {mounts}"
    # the Ray launcher: one RRL_HOME for every node type
    # the Ray launcher: every node type mounts the shared file system at its RRL_HOME
    config = yaml.safe_load(RAY_CLUSTER.read_text())
    setups = [config["setup_commands"]] + [
        t["worker_setup_commands"] for t in config["available_node_types"].values() if "worker_setup_commands" in t
    ]
    for cmds in setups:
        text = "\n".join(cmds)
        homes = set(re.findall(r"RRL_HOME=(\S+?)'", text))
        targets = set(re.findall(r"sudo mount .* (\S+)\)", text))
        assert len(homes) == 1 and homes == targets, f"RRL_HOME {homes} vs mounted {targets}"


def test_api_token_secret_is_wired() -> None:
    secret = _one("Secret")
    assert set(secret["stringData"]) == {"token"}
    ctl = _controller_container()
    ref = _env(ctl)["RRL_TOKEN"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == (secret["metadata"]["name"], "token")
    spec = _one("Deployment", "rrl-controller")["spec"]["template"]["spec"]
    vol = next(v for v in spec["volumes"] if "secret" in v)
    assert vol["secret"]["secretName"] == secret["metadata"]["name"]
    mount = next(m for m in ctl["volumeMounts"] if m["name"] == vol["name"])
    args = next(iter(_rrl_invocations("\n".join(ctl["command"]))))
    token_file = args[args.index("--token-file") + 1]
    assert token_file == f"{mount['mountPath']}/{vol['secret']['items'][0]['path']}"
    # the controller refuses the placeholder instead of serving with a published token
    assert secret["stringData"]["token"] in "\n".join(ctl["command"])
    assert _controller_option("--token-file")


def test_every_rrl_command_and_option_exists() -> None:
    rrl = _rrl()
    seen = 0
    for where, text in _shell_texts().items():
        for args in _rrl_invocations(text):
            cmd = rrl
            path = ["rrl"]
            rest = list(args)
            while _is_group(cmd) and rest and not rest[0].startswith("-"):
                name = rest.pop(0)
                assert name in cmd.commands, f"{where}: `{' '.join(path)} {name}` is not a command"
                cmd = cmd.commands[name]
                path.append(name)
            known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
            for tok in rest:
                if tok.startswith("-") and not re.fullmatch(r"-\d+", tok):
                    assert tok.split("=")[0] in known, f"{where}: `{' '.join(path)}` has no option {tok}"
            seen += 1
    assert seen >= 10, f"found only {seen} rrl commands in deploy/ and docs/deploy.md"


def test_readme_links_the_deploy_doc() -> None:
    assert "(docs/deploy.md)" in (ROOT / "README.md").read_text()


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.mark.slow
def test_start_member_script_brings_up_the_three_member_cluster(tmp_path: Path) -> None:
    """Starts real etcd servers (the one test here that does). The shipped env files and start-member.sh, with the host names swapped for loopback
    ports (and per-member listen URLs and data dirs, since all three share a host here)."""
    from controller.store import Store
    from resilient_rl.local import ManagedProcess

    names = sorted(f.stem for f in ETCD.glob("etcd-*.env"))
    ports = _free_ports(2 * len(names))
    client = {n: ports[2 * i] for i, n in enumerate(names)}
    peer = {n: ports[2 * i + 1] for i, n in enumerate(names)}
    host = {
        n: re.search(r"//([\w.-]+):", _env_file(ETCD / f"{n}.env")["ETCD_ADVERTISE_CLIENT_URLS"]).group(1)
        for n in names
    }  # type: ignore[union-attr]

    def loopback(text: str) -> str:
        for n in names:
            text = text.replace(f"{host[n]}:{ETCD_CLIENT_PORT}", f"127.0.0.1:{client[n]}")
            text = text.replace(f"{host[n]}:{ETCD_PEER_PORT}", f"127.0.0.1:{peer[n]}")
        return text

    conf = tmp_path / "conf"
    conf.mkdir()
    for f in ETCD.glob("*.env"):
        (conf / f.name).write_text(loopback(f.read_text()))
    for n in names:
        with open(conf / f"{n}.env", "a") as f:
            f.write(f"\nETCD_LISTEN_CLIENT_URLS=http://127.0.0.1:{client[n]}\n")
            f.write(f"ETCD_LISTEN_PEER_URLS=http://127.0.0.1:{peer[n]}\n")
            f.write(f"ETCD_DATA_DIR={tmp_path / n}\n")
    env = {"START_MEMBER_CONF": str(conf)}
    procs = [ManagedProcess.spawn(n, [str(ETCD / "start-member.sh"), n], tmp_path / f"{n}.log", env=env) for n in names]
    try:
        store = Store(",".join(f"127.0.0.1:{client[n]}" for n in names), timeout=2.0, retry_window=30.0)
        deadline = time.monotonic() + 60
        while True:
            try:
                store.put("/rrl/v1/deploy-test", b"ok")
                break
            except Exception:
                if time.monotonic() > deadline or not all(p.alive() for p in procs):
                    logs = {n: (tmp_path / f"{n}.log").read_text()[-2000:] for n in names}
                    pytest.fail(f"the 3-member cluster did not come up: {logs}")
                time.sleep(0.2)
        # every member answers (each alone, so each is in the cluster)
        for n in names:
            one = Store(f"127.0.0.1:{client[n]}", timeout=2.0, retry_window=10.0)
            assert one.get("/rrl/v1/deploy-test").value == b"ok"  # type: ignore[union-attr]
            one.close()
        store.close()
    finally:
        for p in procs:
            p.stop()
    # a wrong name is refused with the list of members
    bad = subprocess.run(
        [str(ETCD / "start-member.sh"), "etcd-9"], capture_output=True, text=True, env={**os.environ, **env}
    )
    assert bad.returncode == 2 and all(n in bad.stderr for n in names)
