"""deploy/ and docs/deploy.md's sections on it say only what Courier accepts.

Every `COURIER_*` variable they name is a setting, every example value parses, every `courier ...` command line
parses with the real parser (and `courier cluster haproxy-config` ones print a front), stop timeouts cover
Courier's drain, the systemd unit passes `systemd-analyze verify` (or, without it, holds the keys it needs), the
launchd plist loads, and the Kubernetes sketch's names are replica ids and its HAProxy ConfigMap is what
`courier cluster haproxy-config` prints for its replicas.
"""

from __future__ import annotations

import plistlib
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from courier.cluster.front_process import find_haproxy
from courier.server.cli import build_parser, main
from courier.settings import OPTIONS, Settings
from courier.settings.parsers import parse_replica_id
from courier.status.gateway_metrics import gateway_gauges
from courier.status.scheduler_stats import SchedulerStats

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "courier@.service"
ENV_EXAMPLE = DEPLOY / "systemd" / "courier.env.example"
PLIST = DEPLOY / "launchd" / "dev.courier.replica.plist"
KUBERNETES = DEPLOY / "kubernetes"
# The sections of docs/deploy.md about deploy/; the others have their own tests.
DOC_SECTIONS = ("## Several machines", "## Kubernetes (sketch)")
# What a reader puts in place of the templates' placeholders.
PLACEHOLDERS = {"%i": "r1", "@REPLICA_ID@": "r1", "@PORT@": "8000", "@HOME@": "/Users/example"}
OPTION_BY_ENV = {option.env: option for option in OPTIONS}
COURIER_COMMAND = re.compile(r"(?<![\w.-])(?:[\w./-]*/)?courier\s+(?:serve|cluster)\b.*")
SHELL_OPERATORS = {">", ">>", "|", "&&", ";", "&"}


def fill(text: str) -> str:
    for placeholder, value in PLACEHOLDERS.items():
        text = text.replace(placeholder, value)
    return text


def deploy_texts() -> dict[str, str]:
    return {str(path.relative_to(ROOT)): path.read_text() for path in sorted(DEPLOY.rglob("*")) if path.is_file()}


def doc_sections() -> str:
    """The text of DOC_SECTIONS in docs/deploy.md, each up to the next `## ` heading."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    sections = re.split(r"(?m)^(?=## )", text)
    found = [section for section in sections if section.splitlines()[0] in DOC_SECTIONS]
    assert [section.splitlines()[0] for section in found] == list(DOC_SECTIONS)
    return "".join(found)


def doc_commands() -> list[str]:
    """The docs' command lines: code blocks' lines (continuations joined), and inline code spans with a flag (a
    bare `courier cluster haproxy-config` in prose names the command, it does not run it)."""
    text = doc_sections()
    blocks = re.findall(r"(?ms)^```[a-z]*\n(.*?)^```", text)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    prose = re.sub(r"(?ms)^```.*?^```", "", text)
    return lines + [span for span in re.findall(r"`([^`]+)`", prose) if " --" in span]


def courier_argvs(lines: list[str]) -> list[list[str]]:
    """Each `courier serve|cluster ...` in `lines`, split as a shell would, up to the first shell operator."""
    argvs = []
    for line in lines:
        command = re.sub(r"^(?:#\s*|ExecStart=)", "", line.strip())  # a comment's or a unit's command line
        match = COURIER_COMMAND.match(command)
        if match is None:
            continue  # prose that mentions a command is not one; `sh -c '... courier ...'` is checked by hand
        words = shlex.split(fill(match.group(0)), comments=True)
        cut = next((index for index, word in enumerate(words) if word in SHELL_OPERATORS), len(words))
        argvs.append(words[1:cut])
    return argvs


def yaml_documents(name: str) -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    documents: list[dict[str, Any]] = list(yaml.safe_load_all((KUBERNETES / name).read_text()))
    return documents


def of_kind(documents: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [document for document in documents if document["kind"] == kind]


def all_command_lines() -> list[list[str]]:
    """Every `courier` command line in deploy/ and the docs' sections, the plist's too."""
    lines = [line for text in deploy_texts().values() for line in text.splitlines()]
    plist = plistlib.loads(fill(PLIST.read_text()).encode())
    return [*courier_argvs(lines + doc_commands()), plist["ProgramArguments"][1:]]


def unit_entries(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) for each assignment of a systemd unit, repeated keys included."""
    entries: list[tuple[str, str, str]] = []
    section = ""
    for line in text.splitlines():
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif line and not line.startswith(("#", ";")):
            key, _, value = line.partition("=")
            entries.append((section, key.strip(), value.strip()))
    return entries


def unit_value(key: str) -> str:
    [value] = [value for _, name, value in unit_entries(UNIT.read_text()) if name == key]
    return value


def env_example() -> dict[str, str]:
    """The example environment file's assignments, commented-out ones included."""
    pairs = re.findall(r"(?m)^#?(COURIER_[A-Z0-9_]+)=(.*)$", ENV_EXAMPLE.read_text())
    return dict(pairs)


def drain_bound_s(shutdown_timeout_s: float) -> float:
    """The longest a replica may take from SIGTERM to exit: the drain, then the supervisor's own steps."""
    from courier.server import supervisor

    after = supervisor.ACTOR_STOP_GRACE_S + supervisor.MIN_FLUSH_S + supervisor.ERROR_FLUSH_S
    return shutdown_timeout_s + after + supervisor.MLX_THREAD_JOIN_S


def test_every_courier_variable_named_is_a_setting() -> None:
    texts = {**deploy_texts(), "docs/deploy.md": doc_sections()}
    named = {where: set(re.findall(r"\bCOURIER_[A-Z0-9_]*[A-Z0-9]", text)) for where, text in texts.items()}
    assert {"COURIER_STORAGE", "COURIER_SHUTDOWN_TIMEOUT"} <= named["deploy/systemd/courier.env.example"]
    assert "COURIER_REPLICA_ID" in named["deploy/kubernetes/courier.yaml"]
    assert {
        where: sorted(names - OPTION_BY_ENV.keys()) for where, names in named.items() if names - OPTION_BY_ENV.keys()
    } == {}


def example_values() -> list[tuple[str, str, str]]:
    values = [("courier.env.example", name, value) for name, value in env_example().items()]
    values += [
        ("unit", name, value) for name, value in re.findall(r"(?m)^Environment=(COURIER_\w+)=(\S+)$", UNIT.read_text())
    ]
    plist = plistlib.loads(fill(PLIST.read_text()).encode())
    values += [("plist", name, value) for name, value in plist["EnvironmentVariables"].items()]
    return values


@pytest.mark.parametrize(("where", "name", "value"), example_values())
def test_every_example_value_parses(where: str, name: str, value: str) -> None:
    OPTION_BY_ENV[name].parse(value.replace("%C", "/var/cache").replace("%S", "/var/lib").replace("%i", "r1"))


def test_the_kubernetes_values_parse() -> None:
    [statefulset] = of_kind(yaml_documents("courier.yaml"), "StatefulSet")
    [container] = statefulset["spec"]["template"]["spec"]["containers"]
    literal = {entry["name"]: entry["value"] for entry in container["env"] if "value" in entry}
    assert "COURIER_SHUTDOWN_TIMEOUT" in literal
    for name, value in literal.items():
        if name.startswith("COURIER_"):
            OPTION_BY_ENV[name].parse(value)
    build_parser().parse_args([*container["command"][1:], *container.get("args", [])])
    assert container["command"][0] == "courier"


@pytest.mark.parametrize("argv", all_command_lines(), ids=shlex.join)
def test_every_courier_command_line_parses(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        arguments = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"courier {shlex.join(argv)}: {capsys.readouterr().err}")
    if arguments.command == "cluster":
        assert main(argv, {}) == 0, capsys.readouterr().err
        assert "backend courier_replicas" in capsys.readouterr().out
    if "--replica-id" in argv:
        assert parse_replica_id(argv[argv.index("--replica-id") + 1]) is not None


def test_the_commands_are_all_found() -> None:
    commands = [shlex.join(argv) for argv in all_command_lines()]
    assert "serve --replica-id r1" in commands  # the unit's ExecStart, the plist, the docs
    assert sum(argv.startswith("cluster haproxy-config") for argv in commands) >= 4  # Linux, Mac, k8s twice


def test_the_systemd_unit_drains_restarts_and_is_hardened() -> None:
    entries = {(section, key): value for section, key, value in unit_entries(UNIT.read_text())}
    assert entries[("Service", "ExecStart")].endswith("/courier serve --replica-id %i")
    assert entries[("Service", "KillSignal")] == "SIGTERM"
    assert entries[("Service", "Restart")] == "on-failure"
    assert entries[("Service", "RestartPreventExitStatus")] == "2"  # a usage error: restarting repeats it
    assert int(entries[("Service", "LimitNOFILE")]) > Settings().max_connections
    for key, value in [
        ("DynamicUser", "yes"),
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("StateDirectory", "courier/%i"),
        ("CacheDirectory", "courier/%i"),
    ]:
        assert entries[("Service", key)] == value
    files = [value for _, key, value in unit_entries(UNIT.read_text()) if key == "EnvironmentFile"]
    assert files == ["/etc/courier/courier.env", "-/etc/courier/%i.env"]
    assert ("Install", "WantedBy") in entries


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    # An instance, with ExecStart pointing at this environment's courier (verify checks the binary exists).
    courier = shutil.which("courier", path=str(Path(sys.executable).parent))
    assert courier is not None
    instance = tmp_path / "courier@r1.service"
    instance.write_text(UNIT.read_text().replace("/opt/courier/bin/courier", courier))
    result = subprocess.run(
        ["systemd-analyze", "verify", str(instance)], capture_output=True, text=True, check=False, timeout=60
    )
    findings = [line for line in (result.stdout + result.stderr).splitlines() if "courier@" in line]
    assert result.returncode == 0 and findings == [], result.stdout + result.stderr


def test_stop_timeouts_cover_the_drain() -> None:
    default = Settings().shutdown_timeout
    unit_timeout = float(env_example().get("COURIER_SHUTDOWN_TIMEOUT", default))
    assert float(unit_value("TimeoutStopSec")) >= drain_bound_s(unit_timeout) + 1
    plist = plistlib.loads(PLIST.read_bytes())
    plist_timeout = float(plist["EnvironmentVariables"].get("COURIER_SHUTDOWN_TIMEOUT", default))
    assert plist["ExitTimeOut"] >= drain_bound_s(plist_timeout) + 1


def test_the_kubernetes_pods_drain_within_their_grace_period() -> None:
    default = Settings().shutdown_timeout
    [statefulset] = of_kind(yaml_documents("courier.yaml"), "StatefulSet")
    pod = statefulset["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = {entry["name"]: entry.get("value") for entry in container["env"]}
    [sleep, seconds] = container["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep == "sleep"
    drain = drain_bound_s(float(env.get("COURIER_SHUTDOWN_TIMEOUT") or default))
    assert pod["terminationGracePeriodSeconds"] >= int(seconds) + drain + 1


def test_the_plist_template_loads_and_names_its_replica() -> None:
    template = plistlib.loads(PLIST.read_bytes())
    assert template["Label"] == "dev.courier.replica.@REPLICA_ID@"
    job = plistlib.loads(fill(PLIST.read_text()).encode())
    assert job["Label"] == "dev.courier.replica.r1"
    assert job["ProgramArguments"][0] == "/Users/example/courier/bin/courier"
    assert job["KeepAlive"] == {"SuccessfulExit": False}
    assert job["SoftResourceLimits"]["NumberOfFiles"] > Settings().max_connections
    assert "@" not in job["EnvironmentVariables"]["COURIER_PROMPT_CACHE_DIR"]


def test_the_statefulset_s_pod_names_are_replica_ids_with_a_service_each() -> None:
    documents = yaml_documents("courier.yaml")
    [statefulset] = of_kind(documents, "StatefulSet")
    name, spec = statefulset["metadata"]["name"], statefulset["spec"]
    pods = [f"{name}-{ordinal}" for ordinal in range(spec["replicas"])]
    assert all(parse_replica_id(pod) == pod for pod in pods)
    services = {service["metadata"]["name"]: service["spec"] for service in of_kind(documents, "Service")}
    assert services[spec["serviceName"]]["clusterIP"] == "None"
    for pod in pods:
        assert services[pod]["selector"] == {"statefulset.kubernetes.io/pod-name": pod}
    [container] = spec["template"]["spec"]["containers"]
    [replica_id] = [entry for entry in container["env"] if entry["name"] == "COURIER_REPLICA_ID"]
    assert replica_id["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"


def test_the_haproxy_configmap_is_what_courier_prints_for_the_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    text = (KUBERNETES / "haproxy.yaml").read_text()
    [argv] = courier_argvs(text.splitlines())
    [statefulset] = of_kind(yaml_documents("courier.yaml"), "StatefulSet")
    name, count = statefulset["metadata"]["name"], statefulset["spec"]["replicas"]
    replicas = [argv[index + 1] for index, word in enumerate(argv) if word == "--replica"]
    assert replicas == [f"{name}-{ordinal}={name}-{ordinal}:8000" for ordinal in range(count)]
    assert argv in courier_argvs(doc_commands())  # the docs show the same command
    assert main(argv, {}) == 0
    [configmap] = of_kind(yaml_documents("haproxy.yaml"), "ConfigMap")
    # After a change to the generator: run the command in haproxy.yaml's header and paste its output in.
    assert configmap["data"]["haproxy.cfg"] == capsys.readouterr().out, "regenerate deploy/kubernetes/haproxy.yaml"
    [deployment] = of_kind(yaml_documents("haproxy.yaml"), "Deployment")
    [volume] = deployment["spec"]["template"]["spec"]["volumes"]
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]


@pytest.mark.skipif(find_haproxy() is None, reason="HAProxy is not installed (Debian: apt-get install haproxy)")
def test_haproxy_accepts_the_linux_front_with_its_user_section(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    [argv] = [argv for argv in courier_argvs(doc_commands()) if "r1=10.0.0.1:8000" in argv]
    assert main(argv, {}) == 0
    front = tmp_path / "haproxy.cfg"
    front.write_text(capsys.readouterr().out)
    binary = find_haproxy()
    assert binary is not None
    command = [binary, "-c", "-f", str(front), "-f", str(DEPLOY / "systemd" / "haproxy-user.cfg")]
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_docs_name_the_gateway_metrics_courier_exports() -> None:
    exported = {metric.name for metric in gateway_gauges(SchedulerStats(max_batch=1, max_queue=1), "m")}
    named = set(re.findall(r"vllm:[a-z_]+", doc_sections()))
    assert (
        named
        == exported
        == {
            "vllm:num_requests_waiting",
            "vllm:num_requests_running",
            "vllm:kv_cache_usage_perc",
            "vllm:gpu_cache_usage_perc",
        }
    )
