"""What the Kubernetes manifests and the container image must agree on, and where they lie."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
# Every kustomization the tests render, relative to DEPLOY.
RENDERINGS = ["base", "overlays/production", "overlays/cpu-smoke", "overlays/tensor-parallel"]
# component label -> (gRPC port, termination grace the service's drain needs, in seconds)
COMPONENTS = {"gateway": (50050, 60), "scheduler": (50051, 60), "adapter-store": (50052, 30),
              "executor": (50053, 60)}
# Components that also serve HTTP -> its port (the gateway's OpenAI API).
HTTP_PORTS = {"gateway": 8000}
# Servers a component drains one after the other on SIGTERM, each within its --grace-s (the
# gateway: gRPC, then HTTP); 1 where absent.
DRAINS = {"gateway": 2}
METRICS_PORT = 9090
RUN_AS_USER = 10001
