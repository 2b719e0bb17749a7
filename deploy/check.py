"""Checks the deployments without a cluster or a Docker engine (`make lint-deploy`, part of `make test`).

Runs in its own virtual environment (.venv-lint, from requirements-lint.txt): yamllint on every YAML file of
the repository; the kustomization rendered by kubectl (as it is, and with the api-keys component) and validated
against Kubernetes' own schemas; checkov on the Dockerfile, the Compose files and the rendered manifests.
Prints what each step checked and exits 1 if any step fails.
"""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUSTOMIZATION = DEPLOY / "kubernetes"
BIN = Path(sys.executable).parent  # the tools sit beside this interpreter
# The oldest Kubernetes minor the manifests are meant for, and the newest schema kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.31.0", "1.37.0")
# Custom resources: kubernetes-validate has only the built-in kinds' schemas, so these are left out, by name.
CUSTOM_RESOURCES = {("keda.sh/v1alpha1", "ScaledObject"), ("monitoring.coreos.com/v1", "PodMonitor")}


def run(*command: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([str(part) for part in command], cwd=cwd, text=True, capture_output=True)


def step(name: str, result: subprocess.CompletedProcess, failed: bool = False) -> bool:
    """Print a step's output under its name; True when it passed."""
    ok = result.returncode == 0 and not failed
    print(f"== {name}: {'ok' if ok else 'FAILED'}")
    output = (result.stdout + result.stderr).strip()
    if output:
        print(output)
    return ok


def render(workdir: Path) -> dict[str, list[dict]]:
    """The kustomization rendered as it is ("base") and with the api-keys component ("api-keys")."""
    rendered = {}
    copy = workdir / "kubernetes"
    shutil.copytree(KUSTOMIZATION, copy)
    # the component reads the keys from a file kept out of git; a throwaway one stands in for it here
    (copy / "components" / "api-keys" / "api-keys.txt").write_text("check-only-not-a-key\n")
    kustomization = yaml.safe_load((copy / "kustomization.yaml").read_text())
    variants = {"base": kustomization,
                "api-keys": {**kustomization, "components": ["components/api-keys"]}}
    for name, content in variants.items():
        (copy / "kustomization.yaml").write_text(yaml.safe_dump(content, sort_keys=False))
        result = run(BIN / "kubectl", "kustomize", copy)
        print(f"== kubectl kustomize ({name}): {'ok' if result.returncode == 0 else 'FAILED'}")
        if result.returncode != 0:
            print(result.stderr.strip())
            raise SystemExit(1)
        rendered[name] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return rendered


def main() -> int:
    ok = step("yamllint (every YAML file, .yamllint)", run(BIN / "yamllint", "--strict", "."))
    with tempfile.TemporaryDirectory(prefix="specdec-deploy-check-") as name:
        workdir = Path(name)
        rendered = render(workdir)
        out = workdir / "rendered"  # every rendered resource, for checkov
        core_out = workdir / "core"  # the built-in kinds only, for kubernetes-validate
        out.mkdir()
        core_out.mkdir()
        versions = [arg for version in KUBERNETES_VERSIONS for arg in ("-k", version)]
        for variant, docs in rendered.items():
            (out / f"{variant}.yaml").write_text(yaml.safe_dump_all(docs, sort_keys=False))
            core = []
            for doc in docs:
                if (doc["apiVersion"], doc["kind"]) in CUSTOM_RESOURCES:
                    print(f"-- kubernetes-validate skips {doc['kind']} {doc['metadata']['name']} "
                          f"({doc['apiVersion']}): a custom resource, no schema in kubernetes-validate")
                else:
                    core.append(doc)
            (core_out / f"{variant}.yaml").write_text(yaml.safe_dump_all(core, sort_keys=False))
            result = run(BIN / "kubernetes-validate", "--strict", "--quiet", *versions, core_out / f"{variant}.yaml")
            # an unknown kind is only a warning there; here it fails, so nothing passes unchecked
            ok &= step(f"kubernetes-validate --strict ({variant}: {len(core)} resources, Kubernetes "
                       f"{' and '.join(KUBERNETES_VERSIONS)})", result, failed="WARN" in result.stdout)
        checkov = (BIN / "checkov", "--quiet", "--compact", "--skip-download")
        ok &= step("checkov (Dockerfile)", run(*checkov, "--framework", "dockerfile", "-f", "Dockerfile"))
        ok &= step("checkov (rendered manifests)", run(*checkov, "--framework", "kubernetes", "-d", out))
        # checkov has no Compose checks; its secrets scan covers the Compose files with the rest of deploy/
        ok &= step("checkov secrets (deploy/)", run(*checkov, "--framework", "secrets", "-d", "deploy"))
    print("lint-deploy:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
