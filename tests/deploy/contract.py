"""What the Kubernetes manifests and the container image must agree on, and where they lie."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
# component label -> (gRPC port, termination grace the service's drain needs, in seconds)
COMPONENTS = {"scheduler": (50051, 60), "adapter-store": (50052, 30), "executor": (50053, 60)}
METRICS_PORT = 9090
RUN_AS_USER = 10001
