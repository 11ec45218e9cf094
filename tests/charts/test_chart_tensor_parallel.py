"""The layout for a target too big for one GPU, rendered by the real Helm engine and built by the operator's own
code: the target pool's pods hold two GPUs each and run one process per GPU (rank 0 serves gRPC and starts the
other rank), the draft pool's pods one GPU and one process. What the ranks of a pod share needs no privilege: the
command channel is an abstract Unix socket, torch's symmetric memory passes its handles over Unix sockets in the
pod's writable /tmp, NCCL uses the pod's /dev/shm."""

from chart_render import pod_templates, render, speculative_deployment
from chart_values import GPU, VALUE_SETS
from test_chart_manifests import validate_against_crd


def _container(template: dict) -> dict:
    (container,) = template["spec"]["containers"]
    return container


def test_a_sharded_target_pod_beside_one_gpu_draft_pods():
    manifests = render(VALUE_SETS["tp2-big-target-one-gpu-draft"])
    cr = speculative_deployment(manifests)
    validate_against_crd(cr)
    assert (cr["spec"]["target"]["tensorParallelSize"], cr["spec"]["draft"]["tensorParallelSize"]) == (2, 1)
    pods = pod_templates(manifests)
    target, draft = pods["coder-specsplit-target"], pods["coder-specsplit-draft"]
    serving = _container(target)
    assert serving["resources"]["limits"][GPU] == serving["resources"]["requests"][GPU] == "2"
    command = serving["command"]
    assert command[:4] == ["specsplit", "target", "--model", "/models/llama-3.3-70b-instruct"]
    assert command[command.index("--tensor-parallel-size") + 1] == "2"
    mounts = {m["mountPath"] for m in serving["volumeMounts"]}
    assert {"/dev/shm", "/tmp"} <= mounts
    proposing = _container(draft)
    assert proposing["resources"]["limits"][GPU] == proposing["resources"]["requests"][GPU] == "1"
    assert "--tensor-parallel-size" not in proposing["command"]
    assert "/dev/shm" not in {m["mountPath"] for m in proposing["volumeMounts"]}
