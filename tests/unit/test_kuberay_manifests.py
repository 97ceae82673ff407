"""The KubeRay manifests of ``docker/kuberay/`` parse, and their command lines are real CLI lines.

No Kubernetes here: this checks what can be checked without one. Each ``modalign`` command line
in them is parsed by the CLI's own argparse parser (a renamed or removed option fails here), and
the wiring that is easy to get wrong is checked: images the Dockerfiles build, credentials from
Secrets, the key store on its own volume outside OUT, the metrics port where Prometheus looks.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest
import yaml

from modalign.pipeline.cli import build_parser

pytestmark = pytest.mark.unit

KUBERAY = Path(__file__).resolve().parents[2] / "docker" / "kuberay"
IMAGES = {"modalign-kuberay:0.1.0-cpu", "modalign-kuberay:0.1.0-gpu"}
KEY_STORE = "/var/lib/modalign/keys"


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((KUBERAY / name).read_text()) if d]


def _pod_specs(doc: dict) -> list[dict]:
    if doc["kind"] == "RayJob":
        cluster = doc["spec"]["rayClusterSpec"]
    elif doc["kind"] == "RayCluster":
        cluster = doc["spec"]
    elif doc["kind"] == "Deployment":
        return [doc["spec"]["template"]]
    else:
        return []
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


def _strict(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The parser, and every subcommand's, without prefix matching: an option is named whole."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _strict(sub)
    return parser


def _modalign_args(line: str):
    """The CLI's parse of the ``modalign ...`` command in a shell line (``a && exec modalign ...``)."""
    (cmd,) = [c.strip() for c in line.split("&&") if re.match(r"(exec\s+)?modalign\s", c.strip())]
    argv = shlex.split(cmd)
    argv = argv[1:] if argv[0] == "exec" else argv
    assert argv[0] == "modalign"
    try:
        return _strict(build_parser()).parse_args(argv[1:])
    except SystemExit:
        raise AssertionError(f"not a valid modalign command line: {cmd}") from None


def test_every_manifest_parses_as_yaml():
    kinds = {name: [d["kind"] for d in _docs(name)] for name in
             ("rayjob-batch.yaml", "raycluster-stream.yaml", "watch-deployment.yaml", "secret-example.yaml")}
    assert kinds == {"rayjob-batch.yaml": ["RayJob"], "raycluster-stream.yaml": ["RayCluster"],
                     "watch-deployment.yaml": ["Deployment", "PodMonitor"], "secret-example.yaml": ["Secret"]}


def test_the_batch_job_runs_a_real_command_line_over_s3():
    (job,) = _docs("rayjob-batch.yaml")
    args = _modalign_args(job["spec"]["entrypoint"])
    assert args.command == "run" and args.address == "auto"
    assert args.input.startswith("s3://") and args.out.startswith("s3://")
    assert args.metrics_host == "0.0.0.0" and args.metrics_linger > 0
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]  # the driver runs on the head
    assert head["metadata"]["annotations"]["prometheus.io/port"] == str(args.metrics_port)
    ports = {p["name"]: p["containerPort"] for p in head["spec"]["containers"][0]["ports"]}
    assert ports["metrics"] == args.metrics_port and ports["dashboard"] == 8265  # RayJob submits there


def test_the_watch_runs_a_real_command_line_with_metrics_where_prometheus_looks():
    deployment, monitor = _docs("watch-deployment.yaml")
    (cluster,) = _docs("raycluster-stream.yaml")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    line = " ".join(container["command"][2:] + container["args"])
    args = _modalign_args(line)
    assert args.command == "watch" and args.input.startswith("s3://") and args.out.startswith("s3://")
    # Not Ray Client: it does not carry streaming generators. The pod joins the cluster's head instead.
    assert args.address == "auto" and not line.count("ray://")
    assert f"ray start --address={cluster['metadata']['name']}-head-svc:6379" in line
    assert "exec modalign watch" in line  # modalign is PID 1: SIGTERM reaches it and drains
    assert args.metrics_host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == args.metrics_port == int(pod["metadata"]["annotations"]["prometheus.io/port"])
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert monitor["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"


@pytest.mark.parametrize("name", ["rayjob-batch.yaml", "raycluster-stream.yaml", "watch-deployment.yaml"])
def test_images_credentials_and_key_store(name):
    (doc, *_rest) = _docs(name)
    pods = _pod_specs(doc)
    assert pods
    for pod in pods:
        spec = pod["spec"]
        containers = spec["containers"] + spec.get("initContainers", [])
        assert {c["image"] for c in containers} <= IMAGES
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            env = {e["name"]: e for e in c.get("env", [])}
            if not env:  # the stream cluster's head runs no work: no credentials, no keys
                assert doc["kind"] == "RayCluster" and c["name"] == "ray-head"
                continue
            for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # from a Secret, never a literal
                assert "value" not in env[var] and env[var]["valueFrom"]["secretKeyRef"]["name"] == "modalign-s3"
            assert env["AWS_ENDPOINT_URL"]["valueFrom"]["secretKeyRef"]["optional"] is True  # AWS S3: unset
            assert env["MODALIGN_KEY_STORE"]["value"] == KEY_STORE
            mount = next(m for m in c["volumeMounts"] if m["mountPath"] == KEY_STORE)
            assert "emptyDir" in volumes[mount["name"]]  # its own volume, filled from the Secret at start
        if "initContainers" not in spec:
            assert doc["kind"] == "RayCluster" and spec["containers"][0]["name"] == "ray-head"
            continue
        (init,) = [c for c in spec["initContainers"] if c["name"] == "key-store"]
        assert volumes[next(m["name"] for m in init["volumeMounts"] if m["readOnly"])]["secret"]["secretName"] \
            == "modalign-keys"


def test_the_images_are_the_ones_the_dockerfiles_build():
    dockerfile = (KUBERAY / "Dockerfile").read_text()
    base = re.search(r"^ARG BASE=(\S+)$", dockerfile, re.M).group(1)
    assert base == "modalign:0.1.0-cpu" and "ray[default]==2.60.0" in dockerfile and " wget" in dockerfile
    for image in IMAGES:  # the build lines in its header name every image the manifests use
        assert f"-t {image}" in dockerfile or f"tag {image}" in dockerfile, image
    for flavour in ("cpu", "gpu"):
        assert (KUBERAY.parent / f"Dockerfile.{flavour}").is_file()
        assert f"-f docker/Dockerfile.{flavour} -t modalign:0.1.0-{flavour}" in dockerfile \
            or f"BASE=modalign:0.1.0-{flavour}" in dockerfile
    pins = re.search(r'"ray\[data\]==([\d.]+)"', (KUBERAY.parents[1] / "pyproject.toml").read_text()).group(1)
    assert f"ray[default]=={pins}" in dockerfile  # the dashboard of the same Ray
    for name in ("rayjob-batch.yaml", "raycluster-stream.yaml"):
        (doc,) = _docs(name)
        spec = doc["spec"].get("rayClusterSpec", doc["spec"])
        assert spec["rayVersion"] == pins
