"""Kubernetes manifests for a run on GKE: the learner on a TPU slice, rollout servers,
their router and environment workers.

  python -m jaxagent.deploy gke --config configs/tiny.yaml --tpu-type v5litepod-16
      --servers 4 --env-workers 8 --image IMAGE --out DIR [--bucket gs://B/runs]
      [--server-image GPU_IMAGE] [--server-accelerator nvidia-l4] [--namespace default] [overrides ...]

Writes one YAML file per resource into DIR (`kubectl apply -f DIR`):
- `configmap.yaml`: the resolved run config, mounted at /config/run.yaml;
- `learner-jobset.yaml`: a JobSet (jobset.x-k8s.io/v1alpha2) of one slice: one pod
  per TPU host (an Indexed Job, parallelism = completions = hosts), the slice's
  accelerator and topology node selectors and `google.com/tpu` requests;
  `jax.distributed` initialises itself on the slice (`jaxagent.distributed`);
- `rollout-statefulset.yaml` + `rollout-service.yaml`: N rollout servers with
  stable names (a headless Service) on an accelerator node pool;
- `router-deployment.yaml` + `router-service.yaml`: the session router over them;
- `control-secret.yaml`: the run's control token (`jaxagent.control`), which the
  learner, the servers and the router take as JAXAGENT_CONTROL_TOKEN, and
  `env-secret.yaml`: its environment token, which the learner and the environment
  workers take as JAXAGENT_ENV_TOKEN; each made once, and kept by a later deploy into
  the same directory (the files are the owner's alone);
- `env-statefulset.yaml` + `env-service.yaml` + `env-networkpolicy.yaml`: M
  environment workers on the CPU pool (stateful sessions, so each has a stable name
  the learner lists), privileged (bubblewrap mounts a proc of its own, which a
  container's masked /proc refuses), without a service-account token, reached from
  their namespace alone and reaching the run's own pods and DNS alone.
The run directory lives in `--bucket` (gs://BUCKET[/PREFIX]), mounted at /runs in the
learner and the rollout servers by GKE's GCS FUSE CSI driver, so metrics,
checkpoints and the policy exports the servers load are plain paths.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import os
import re
import shlex
import sys
from typing import Any

from jaxagent import config as config_lib, control


@dataclasses.dataclass(frozen=True)
class TpuSlice:
  """A TPU slice type as GKE schedules it."""

  name: str  # e.g. v5litepod-16
  accelerator: str  # cloud.google.com/gke-tpu-accelerator
  topology: str  # cloud.google.com/gke-tpu-topology
  chips: int
  chips_per_host: int

  @property
  def hosts(self) -> int:
    return self.chips // self.chips_per_host


# name prefix -> (GKE accelerator label, chips per host of a multi-host slice, TensorCores
# counted per chip in the type's number, topology by chip count).
_FAMILIES = {
    "v5litepod": ("tpu-v5-lite-podslice", 4, 1,
                  {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8",
                   128: "8x16", 256: "16x16"}),
    "v6e": ("tpu-v6e-slice", 4, 1,
            {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
             256: "16x16"}),
    "v5p": ("tpu-v5p-slice", 4, 2,
            {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8"}),
    "v4": ("tpu-v4-podslice", 4, 2,
           {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4"}),
}


def check_on_slice(cfg: config_lib.RunConfig, sl: TpuSlice) -> None:
  """The learner's mesh and rows checks with the slice's chips and hosts (one process a
  host, its chips its devices in order): a config the slice refuses failed in the
  cluster, `--max-restarts` times, where it passed here (`data.rows` not split between
  the hosts, a mesh of other than the slice's chips, a tensor axis across hosts; a
  reviewer). ConfigError naming the key."""
  import types

  import numpy as np

  from jaxagent.models.sharding import MESH_AXES, mesh_data
  from jaxagent.run_services import MULTI_PROCESS_DEVICES, MULTI_PROCESS_MESH
  from jaxagent.training_run import check_process_rows

  m = cfg.mesh
  if m.devices and sl.hosts > 1:  # (as the learner's own mesh refuses it)
    raise config_lib.ConfigError(MULTI_PROCESS_DEVICES)
  if m.devices:  # (one host: the learner says which of its chips it uses)
    return
  try:  # (the learner's own mesh arithmetic, on the slice's chips)
    data = mesh_data(m.data, m.fsdp, m.tensor, sl.chips)
  except ValueError as e:
    raise config_lib.ConfigError(f"mesh: {e} (the slice {sl.name}'s chips)") from None
  n = data * m.fsdp * m.tensor
  if n < sl.chips and sl.hosts > 1:  # (one host's learner may leave chips to its engine)
    raise config_lib.ConfigError(
        f"mesh.data x mesh.fsdp x mesh.tensor is {n} devices, of the {sl.chips} chips of "
        f"the slice {sl.name}: {MULTI_PROCESS_MESH}")
  grid = np.asarray([types.SimpleNamespace(process_index=i // sl.chips_per_host)
                     for i in range(n)], dtype=object)
  shape = dict(zip(MESH_AXES, (data, m.fsdp, m.tensor)))
  check_process_rows(cfg, types.SimpleNamespace(
      devices=grid.reshape(data, m.fsdp, m.tensor), axis_names=MESH_AXES, shape=shape),
      sl.hosts)


def tpu_slice(name: str) -> TpuSlice:
  """Parses `v5litepod-16`, `v5p-32`, `v6e-8`, `v4-16`; errors list what is known."""
  m = re.fullmatch(r"(v5litepod|v6e|v5p|v4)-(\d+)", name)
  known = ", ".join(f"{f}-N" for f in _FAMILIES)
  if not m:
    raise ValueError(f"--tpu-type {name!r}: expected one of {known}")
  family, n = m.group(1), int(m.group(2))
  accel, per_host, cores, topologies = _FAMILIES[family]
  chips = n // cores
  if chips not in topologies:
    raise ValueError(f"--tpu-type {name!r}: {chips} chips is not a {family} slice GKE "
                     f"offers here; known sizes: "
                     f"{', '.join(f'{family}-{c * cores}' for c in sorted(topologies))}")
  # v5e and v6e hosts of 1, 4 or 8 chips serve slices up to 8 chips alone; bigger
  # slices (and every v5p / v4 slice) have 4 chips a host.
  single_host_max = 8 if family in ("v5litepod", "v6e") else per_host
  return TpuSlice(name, accel, topologies[chips], chips,
                  chips if chips <= single_host_max else per_host)


def run_name(cfg: config_lib.RunConfig) -> str:
  """The run's name as Kubernetes names take it (lower case, dashes, <= 40 chars,
  starting with a letter: Service names must)."""
  name = re.sub(r"[^a-z0-9-]", "-", cfg.name.lower()).strip("-")[:40].strip("-") or "run"
  return name if name[0].isalpha() else f"run-{name}"[:40].strip("-")


def _labels(app: str, run: str) -> dict:
  return {"app.kubernetes.io/name": app, "app.kubernetes.io/part-of": "jaxagent",
          "jaxagent/run": run}


def _container(name: str, image: str, command: list[str], *, port: int = 0,
               resources: dict | None = None, mount_config: bool = True) -> dict:
  c: dict[str, Any] = {"name": name, "image": image, "command": command}
  if port:
    c["ports"] = [{"containerPort": port, "name": "http"}]
    c["readinessProbe"] = {"httpGet": {"path": "/health", "port": port},
                           "periodSeconds": 5}
  if resources:
    c["resources"] = resources
  if mount_config:
    c["volumeMounts"] = [{"name": "config", "mountPath": "/config", "readOnly": True}]
  return c


def _config_volume(run: str) -> dict:
  return {"name": "config", "configMap": {"name": f"{run}-config"}}


PLACEHOLDER_BUCKET = "gs://BUCKET/runs"  # (--bucket's default: said as such)


# Checkpoints and policy exports are finalised by renaming their directories (Orbax's
# temporary step directory, `vN.new` -> `vN`): on a bucket without a hierarchical
# namespace gcsfuse refuses to rename a directory that holds anything unless given a
# limit (the first export failed, and every restart with it: a reviewer), and renames
# by copying each object then deleting it (not atomic: docs/training.md).
MOUNT_OPTIONS = "implicit-dirs,rename-dir-limit=1000000"


def _mount_bucket(pod: dict, container: dict, bucket: str) -> None:
  """Mounts `bucket` at /runs with the GKE GCS FUSE CSI driver."""
  pod.setdefault("volumes", []).append({
      "name": "runs", "csi": {"driver": "gcsfuse.csi.storage.gke.io",
                              "volumeAttributes": {"bucketName": bucket,
                                                   "mountOptions": MOUNT_OPTIONS}}})
  container.setdefault("volumeMounts", []).append({"name": "runs", "mountPath": "/runs"})


# The run's tokens (`jaxagent.control`): each one's Secret's file, the end of its name
# (`{run}-{end}`), and the annotation of its hash on the pods that take it.
SECRETS = {control.CONTROL: ("control-secret.yaml", "control", "jaxagent/control-token-sha256"),
           control.ENVS: ("env-secret.yaml", "env-token", "jaxagent/env-token-sha256")}


def _secret(run: str, key: control.Key) -> str:
  """The name of the Secret that holds the run's token `key`."""
  return f"{run}-{SECRETS[key][1]}"


def _token_env(run: str, *keys: control.Key) -> list[dict]:
  """A container's token variables, each from the run's Secret."""
  return [{"name": key.env, "valueFrom": {"secretKeyRef": {
      "name": _secret(run, key), "key": "token"}}} for key in keys]


def _token_hash(key: control.Key, token: str) -> dict:
  """The pod annotation that changes with the token a pod takes (so a new one restarts
  the pods that take it)."""
  return {SECRETS[key][2]: hashlib.sha256(token.encode()).hexdigest()[:16]}


def kept_tokens(out_dir: str, run: str) -> dict:
  """The tokens (`control.Key` -> token) an earlier deploy of `run` wrote into `out_dir`
  (a token made anew would differ from the one the running pods took)."""
  import yaml

  kept = {}
  for key, (name, _, _) in SECRETS.items():
    try:
      with open(os.path.join(out_dir, name)) as f:
        secret = yaml.safe_load(f)
      if secret["metadata"]["name"] == _secret(run, key) and secret["stringData"]["token"]:
        kept[key] = str(secret["stringData"]["token"])
    except (OSError, yaml.YAMLError, KeyError, TypeError):
      pass
  return kept


def manifests(cfg: config_lib.RunConfig, args, tokens: dict | None = None
              ) -> dict[str, dict]:
  """File name -> Kubernetes object, for the run `cfg` with the CLI's `args`; with
  servers, the run's control token, with environment workers its environment token, each
  in a Secret (`tokens`' where it holds one, `control.Key` -> token, or a new one)."""
  from omegaconf import OmegaConf

  from jaxagent.launch import server_config, without_served_models

  sl = tpu_slice(args.tpu_type)
  run = run_name(cfg)
  ns = args.namespace
  meta = lambda name, app: {"name": name, "namespace": ns, "labels": _labels(app, run)}
  server_port, router_port, env_port = 8000, 8000, 8100
  rollout_svc, env_svc = f"{run}-rollout", f"{run}-env"
  servers = [f"http://{run}-rollout-{i}.{rollout_svc}.{ns}.svc:{server_port}"
             for i in range(args.servers)]
  envs = [f"http://{run}-env-{i}.{env_svc}.{ns}.svc:{env_port}"
          for i in range(args.env_workers)]
  router_url = f"http://{run}-router.{ns}.svc:{router_port}"
  bucket, _, prefix = args.bucket.removeprefix("gs://").partition("/")
  if not args.bucket.startswith("gs://") or not bucket:
    raise ValueError(f"--bucket {args.bucket!r}: expected gs://BUCKET[/PREFIX]")
  if args.bucket != PLACEHOLDER_BUCKET and not re.fullmatch(
      r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]", bucket):
    raise ValueError(f"--bucket {args.bucket!r}: {bucket!r} is not a bucket name (lower-case "
                     "letters, digits, '-', '_' and '.', 3-222 characters, starting and "
                     "ending with a letter or digit)")
  parts = [x for x in prefix.split("/") if x]
  if any(x in (".", "..") or not x.isprintable() or x.strip() != x for x in parts):
    # (`gs://b/../../etc` put the run directory outside the mount, on the pod's own disk,
    # which a restart loses and the servers never see: a reviewer)
    raise ValueError(f"--bucket {args.bucket!r}: its path holds '.', '..', spaces or "
                     "unprintable characters; give gs://BUCKET[/PREFIX] with a plain prefix")
  # The bucket is mounted by the GCS FUSE CSI driver at /runs in the learner and the
  # rollout servers: metrics, checkpoints and policy exports are plain paths, and the
  # servers load the exports the learner writes.
  run_dir = "/".join(x for x in ("/runs", prefix.strip("/"), run) if x)
  out: dict[str, dict] = {}

  out["configmap.yaml"] = {
      "apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(f"{run}-config", "config"),
      "data": {"run.yaml": OmegaConf.to_yaml(OmegaConf.create(config_lib.literal(
                   config_lib.to_dict(without_served_models(cfg) if servers else cfg)))),
               "server.yaml": OmegaConf.to_yaml(OmegaConf.create(config_lib.literal(
                   server_config(cfg, server_port, host="0.0.0.0"))))}}

  # A restarted learner (JobSet failurePolicy: a failure or a preemption, which exits
  # non-zero) goes on from the run's last checkpoint.
  learner_cmd = ["python", "-m", "jaxagent.train", "--config", "/config/run.yaml",
                 "--run-dir", run_dir, "--auto-resume"]
  if servers:
    learner_cmd.append(f"serving.urls=[\"{router_url}\"]")
  if envs:
    learner_cmd.append("env.urls=[" + ",".join(f'"{u}"' for u in envs) + "]")
  tpu = {"google.com/tpu": str(sl.chips_per_host)}
  learner = _container("learner", args.image, learner_cmd,
                       resources={"requests": tpu, "limits": tpu})
  # The tokens: the control token where there are servers (without, the learner's
  # in-process gateway makes its own), the environment token where there are workers.
  # Each token's hash on every pod that takes it: a new token (a deploy from another
  # directory) changes their templates, so the servers, the router and the workers
  # restart with it (a server kept the old one and refused the new learner's updates); a
  # JobSet's template cannot change: its learner is deleted and applied again.
  hashes: dict = {}
  for key, wanted in ((control.CONTROL, servers), (control.ENVS, envs)):
    if not wanted:
      continue
    token = (tokens or {}).get(key) or control.new_token()
    out[SECRETS[key][0]] = {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque", "stringData": {"token": token},
        "metadata": meta(_secret(run, key), SECRETS[key][1])}
    hashes[key] = _token_hash(key, token)
  if hashes:
    learner["env"] = _token_env(run, *hashes)
  ruled = hashes.get(control.CONTROL, {})
  learner_hashes = {k: v for h in hashes.values() for k, v in h.items()}
  pod = {
      "restartPolicy": "Never",
      "nodeSelector": {"cloud.google.com/gke-tpu-accelerator": sl.accelerator,
                       "cloud.google.com/gke-tpu-topology": sl.topology},
      "containers": [learner],
      "volumes": [_config_volume(run)],
  }
  _mount_bucket(pod, pod["containers"][0], bucket)
  out["learner-jobset.yaml"] = {
      "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
      "metadata": {**meta(f"{run}-learner", "learner"),
                   "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology":
                                   "cloud.google.com/gke-nodepool"}},
      "spec": {
          "failurePolicy": {"maxRestarts": args.max_restarts},
          "network": {"enableDNSHostnames": True},
          "replicatedJobs": [{
              "name": "slice", "replicas": 1,
              "template": {"spec": {
                  "parallelism": sl.hosts, "completions": sl.hosts,
                  "completionMode": "Indexed", "backoffLimit": 0,
                  "template": {"metadata": {"labels": _labels("learner", run),
                                            "annotations": {**_FUSE, **learner_hashes}},
                               "spec": pod}}}}]}}

  gpu = ({"nvidia.com/gpu": "1"} if args.server_accelerator.startswith("nvidia") else {})
  server_pod = {
      "containers": [_container("rollout", args.server_image or args.image,
                                ["python", "-m", "rollout_server", "--config",
                                 "/config/server.yaml"], port=server_port,
                                resources={"requests": {"cpu": "4", "memory": "16Gi", **gpu},
                                           "limits": gpu} if gpu else
                                {"requests": {"cpu": "4", "memory": "16Gi"}})],
      "volumes": [_config_volume(run)]}
  server_pod["containers"][0]["env"] = _token_env(run, control.CONTROL)
  if gpu:
    server_pod["nodeSelector"] = {"cloud.google.com/gke-accelerator": args.server_accelerator}
  _mount_bucket(server_pod, server_pod["containers"][0], bucket)
  if not servers:  # (the learner serves its rollouts itself)
    return _env_workers(out, cfg, args, run, meta, envs, env_svc, env_port,
                        hashes.get(control.ENVS))
  out["rollout-statefulset.yaml"] = _statefulset(
      meta(f"{run}-rollout", "rollout"), rollout_svc, args.servers, server_pod,
      _labels("rollout", run), annotations={**_FUSE, **ruled})
  out["rollout-service.yaml"] = _headless(meta(rollout_svc, "rollout"),
                                          _labels("rollout", run), server_port)

  router_pod = {"containers": [_container(
      "router", args.image,
      ["python", "-m", "rollout_server.router", "--backends", ",".join(servers),
       "--host", "0.0.0.0", "--port", str(router_port)], port=router_port,
      resources={"requests": {"cpu": "1", "memory": "1Gi"}}, mount_config=False)]}
  router_pod["containers"][0]["env"] = _token_env(run, control.CONTROL)
  out["router-deployment.yaml"] = {
      "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(f"{run}-router", "router"),
      "spec": {"replicas": 1, "selector": {"matchLabels": _labels("router", run)},
               "template": {"metadata": {"labels": _labels("router", run),
                                         "annotations": ruled},
                            "spec": router_pod}}}
  out["router-service.yaml"] = {
      "apiVersion": "v1", "kind": "Service", "metadata": meta(f"{run}-router", "router"),
      "spec": {"selector": _labels("router", run),
               "ports": [{"name": "http", "port": router_port, "targetPort": router_port}]}}

  return _env_workers(out, cfg, args, run, meta, envs, env_svc, env_port,
                      hashes.get(control.ENVS))


def _env_workers(out: dict, cfg: config_lib.RunConfig, args, run: str, meta, envs: list,
                 env_svc: str, env_port: int, token_hash: dict | None) -> dict:
  """Adds the environment workers' StatefulSet and Service to `out` (none for none):
  they take the environment token (never the control token: they run the policy's
  code), `token_hash` its annotation."""
  if not envs:  # (the learner runs its environments itself)
    return out
  env_cmd = ["python", "-m", "envs.server", "--host", "0.0.0.0", "--port", str(env_port),
             "--sandboxes", str(args.sandboxes)]
  for module in cfg.env.imports:  # (the image must hold them)
    env_cmd += ["--import", module]
  if cfg.env.allow_unisolated:  # (as launch local passes it on)
    env_cmd.append("--allow-unisolated")
  for cgroup in cfg.env.cgroups:  # (as launch local passes them on: they were dropped)
    env_cmd += ["--cgroup", cgroup]
  env_container = _container("env", args.image, env_cmd, port=env_port, mount_config=False,
                             resources={"requests": {"cpu": str(args.sandboxes),
                                                     "memory": "8Gi"}})
  # bubblewrap builds user, mount and PID namespaces for each sandbox, and mounts a proc
  # of its own: the kernel refuses that over a container's masked /proc (SYS_ADMIN with
  # seccomp unconfined was not enough: "Can't mount proc", a reviewer, reproduced with
  # /proc masked as containerd masks it), so the worker's container is privileged; tool
  # code runs inside bubblewrap as an unprivileged uid with a seccomp filter, never with
  # the container's privileges. The worker needs no Kubernetes API: no token mounted.
  env_container["securityContext"] = {"privileged": True}
  env_container["env"] = _token_env(run, control.ENVS)
  env_pod = {"containers": [env_container], "automountServiceAccountToken": False,
             "nodeSelector": {"cloud.google.com/gke-nodepool": args.cpu_pool}}
  out["env-statefulset.yaml"] = _statefulset(meta(f"{run}-env", "env"), env_svc,
                                             args.env_workers, env_pod, _labels("env", run),
                                             annotations=token_hash)
  out["env-service.yaml"] = _headless(meta(env_svc, "env"), _labels("env", run), env_port)
  # The workers run the policy's code (in bubblewrap, in a privileged container): only
  # pods of their namespace reach them (the learner: the JobSet's, or xpk's, which
  # carries no label of ours), and they reach only the run's own pods (a served judge,
  # through the router or a server) and the cluster's DNS; not the metadata server, the
  # cluster's other services, or the internet.
  out["env-networkpolicy.yaml"] = {
      "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
      "metadata": meta(f"{run}-env", "env"),
      "spec": {"podSelector": {"matchLabels": _labels("env", run)},
               "policyTypes": ["Ingress", "Egress"],
               "ingress": [{"from": [{"podSelector": {}}],
                            "ports": [{"protocol": "TCP", "port": env_port}]}],
               "egress": [{"to": [{"podSelector": {"matchLabels": {"jaxagent/run": run}}}]},
                          {"to": [{"namespaceSelector": {}, "podSelector": {
                              "matchLabels": {"k8s-app": "kube-dns"}}}],
                           "ports": [{"protocol": "UDP", "port": 53},
                                     {"protocol": "TCP", "port": 53}]}]}}
  return out


# The pod annotation that asks GKE to inject the GCS FUSE sidecar.
_FUSE = {"gke-gcsfuse/volumes": "true"}


def _statefulset(metadata: dict, service: str, replicas: int, pod: dict, labels: dict,
                 annotations: dict | None = None) -> dict:
  template = {"metadata": {"labels": labels}, "spec": pod}
  if annotations:
    template["metadata"]["annotations"] = annotations
  return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": metadata,
          "spec": {"serviceName": service, "replicas": replicas,
                   "podManagementPolicy": "Parallel",
                   "selector": {"matchLabels": labels}, "template": template}}


def _headless(metadata: dict, labels: dict, port: int) -> dict:
  return {"apiVersion": "v1", "kind": "Service", "metadata": metadata,
          "spec": {"clusterIP": "None", "selector": labels,
                   "ports": [{"name": "http", "port": port, "targetPort": port}]}}


def xpk_command(cfg: config_lib.RunConfig, args, objects: dict) -> str:
  """The learner's launch as an `xpk workload create` command (xpk users' path): the
  JobSet's learner command (its run directory and services), with the run's config from
  the image and these overrides instead of the ConfigMap."""
  sl = tpu_slice(args.tpu_type)
  run = run_name(cfg)
  pod = objects["learner-jobset.yaml"]["spec"]["replicatedJobs"][0]["template"]["spec"][
      "template"]["spec"]
  learner = pod["containers"][0]["command"]
  at = learner.index("--config")
  cmd = shlex.join([*learner[:at + 1], args.config, *learner[at + 2:], *args.overrides])
  xpk = (f"xpk workload create --cluster CLUSTER --workload {run}-learner "
         f"--tpu-type {sl.name} --num-slices 1 --docker-image {args.image} --command ")
  held = [(key, objects[name]["metadata"]) for key, (name, _, _) in SECRETS.items()
          if name in objects]
  if not held:
    return xpk + shlex.quote(cmd)
  # xpk's pod does not mount the Secrets: the command takes each token from its Secret
  # where it is typed (never printed here), and stops there when one is not applied yet.
  reads = " && ".join(
      f"T{i}=$(kubectl get secret {secret['name']} -n {secret['namespace']} "
      f"-o jsonpath='{{.data.token}}' | base64 -d) && test -n \"$T{i}\""
      for i, (_, secret) in enumerate(held))
  given = " ".join(f"{key.env}=$T{i}" for i, (key, _) in enumerate(held))
  return f'{reads} && {xpk}"{given} "' + shlex.quote(cmd)


def write(out_dir: str, objects: dict[str, dict]) -> list[str]:
  from omegaconf import OmegaConf

  os.makedirs(out_dir, exist_ok=True)
  # The manifests a deploy can write that this one does not are removed: `kubectl apply
  # -f OUT` deployed a first deploy's servers after a second without them. (Other files in
  # the directory are left alone.)
  for name in MANIFESTS - set(objects):
    with contextlib.suppress(FileNotFoundError):
      os.remove(os.path.join(out_dir, name))
  paths = []
  for name, obj in objects.items():
    path = os.path.join(out_dir, name)
    if obj.get("kind") == "Secret":  # (the owner's alone, from its first byte)
      with contextlib.suppress(FileNotFoundError):
        os.remove(path)
      f = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w")
    else:
      f = open(path, "w")
    with f:
      f.write(OmegaConf.to_yaml(OmegaConf.create(obj)))
    paths.append(path)
  return paths


# Every manifest `gke` may write (with servers and env workers).
MANIFESTS = {"configmap.yaml", "learner-jobset.yaml", "rollout-statefulset.yaml",
             "rollout-service.yaml", "router-deployment.yaml", "router-service.yaml",
             "control-secret.yaml", "env-secret.yaml",
             "env-statefulset.yaml", "env-service.yaml", "env-networkpolicy.yaml"}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
      allow_abbrev=False, prog="python -m jaxagent.deploy", description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="where", required=True)
  g = sub.add_parser("gke", allow_abbrev=False, help="manifests for GKE")
  g.add_argument("--config", required=True)
  g.add_argument("--tpu-type", required=True, help="the learner's slice, e.g. v5litepod-16")
  g.add_argument("--servers", type=int, default=4)
  g.add_argument("--env-workers", type=int, default=8)
  g.add_argument("--sandboxes", type=int, default=None,
                 help="sandboxes per environment worker (default: the config's env.sandboxes)")
  g.add_argument("--image", required=True,
                 help="the learner's image (JAX for its chips: --build-arg JAX_EXTRA=tpu), also the "
                      "router's and the environment workers'")
  g.add_argument("--server-image", default=None,
                 help="the rollout servers' image (JAX for their accelerator: JAX_EXTRA=cuda12 "
                      "on an nvidia pool); default --image, whose JAX may not be for the "
                      "servers' accelerator (a TPU image has no CUDA)")
  g.add_argument("--out", required=True)
  g.add_argument("--bucket", default=None,
                 help=f"where run directories go (default: a placeholder, {PLACEHOLDER_BUCKET}, "
                      "to replace before the manifests are applied)")
  g.add_argument("--namespace", default="default")
  g.add_argument("--server-accelerator", default="nvidia-l4",
                 help="GKE accelerator of the rollout servers' pool (cpu: none)")
  g.add_argument("--cpu-pool", default="cpu-pool", help="node pool of environment workers")
  g.add_argument("--max-restarts", type=int, default=3)
  g.add_argument("overrides", nargs="*")
  args = config_lib.parse_with_overrides(p, argv, config_lib.RunConfig)
  args.bucket = args.bucket or PLACEHOLDER_BUCKET
  try:
    cfg = config_lib.load(config_lib.RunConfig, args.config, args.overrides)
    if args.servers < 0 or args.env_workers < 0:
      raise ValueError("--servers and --env-workers must be >= 0")
    if args.sandboxes is None:
      args.sandboxes = cfg.env.sandboxes
    if args.sandboxes < 1:
      raise ValueError(f"--sandboxes must be >= 1, got {args.sandboxes}")
    if args.max_restarts < 0:
      raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.server_accelerator != "cpu" and not re.fullmatch(
        r"nvidia-[a-z0-9-]+", args.server_accelerator):
      # (any other value asked for no accelerator: the servers ran JAX on a CPU node, and
      # the warning below said they ran on it: a reviewer)
      raise ValueError(f"--server-accelerator {args.server_accelerator!r}: a GKE GPU "
                       "accelerator (nvidia-l4, nvidia-h100-80gb, ...) or cpu")

    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", args.namespace):
      raise ValueError(f"--namespace {args.namespace!r}: a Kubernetes namespace is lower-case "
                       "letters, digits and '-', starting and ending with a letter or digit")
    from jaxagent.launch import check_with_services

    # The learner's checks, with the services it will be given (the router, the workers):
    # a config the learner refuses would fail in the cluster, restarts and all.
    check_with_services(cfg, 1 if args.servers else 0, args.env_workers)
    check_on_slice(cfg, tpu_slice(args.tpu_type))
    kept = kept_tokens(args.out, run_name(cfg))
    objects = manifests(cfg, args, kept)
  except (config_lib.ConfigError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  for path in write(args.out, objects):
    print(path)
  # (a bucket or an image left at its default wrote manifests that cannot run, and said
  # nothing: a new user)
  if args.bucket == PLACEHOLDER_BUCKET:
    print(f"warning: no --bucket: the manifests mount {PLACEHOLDER_BUCKET}, a placeholder; "
          "give --bucket gs://YOUR_BUCKET/runs (the run directories) before applying them",
          file=sys.stderr)
  if args.servers and args.server_image is None and args.server_accelerator != "cpu":
    print(f"warning: no --server-image: the rollout servers run --image ({args.image}) on "
          f"{args.server_accelerator}; a TPU image has no CUDA (build one with "
          "JAX_EXTRA=cuda12, docs/training.md)", file=sys.stderr)
  print(f"apply: kubectl apply -f {args.out}")
  fresh = [s[0] for key, s in SECRETS.items() if s[0] in objects and key not in kept]
  if kept and fresh:  # (a JobSet's template cannot change: apply would refuse it)
    jobset = objects["learner-jobset.yaml"]["metadata"]
    print(f"{' and '.join(fresh)} hold{'s' if len(fresh) == 1 else ''} a new token the "
          "learner takes: delete its JobSet first (kubectl delete jobset "
          f"{jobset['name']} -n {jobset['namespace']}; it resumes from its checkpoint)")
  secrets = [os.path.join(args.out, s[0]) for s in SECRETS.values() if s[0] in objects]
  if secrets:
    print(f"{' and '.join(secrets)} hold{'s' if len(secrets) == 1 else ''} the run's "
          f"token{'s' if len(secrets) > 1 else ''} (readable by you alone): keep "
          f"{'it' if len(secrets) == 1 else 'them'} out of version control")
  if args.servers and cfg.serving.models:
    # (xpk's learner runs the image's config, whose serving.models the learner refuses
    # beside servers: the ConfigMap's leaves them to the servers; a reviewer)
    print("(no xpk line: the config's serving.models are served by the rollout servers, "
          "and xpk's learner would run the image's config, which serves them itself beside "
          "servers, refused; apply the JobSet)")
    return 0
  if not secrets:
    print(f"or, with xpk (the bucket mounted at /runs): {xpk_command(cfg, args, objects)}")
    return 0
  others = [os.path.join(args.out, n) for n in objects if n != "learner-jobset.yaml"]
  print("or, with xpk (the bucket mounted at /runs): first\n  kubectl apply "
        + " ".join(f"-f {shlex.quote(p)}" for p in others) + "\nthen\n  "
        + xpk_command(cfg, args, objects) + "\n(the learner's workload then holds the "
        "tokens in its command: whoever can read its pods can read them)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
