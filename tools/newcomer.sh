#!/usr/bin/env bash
# A new user's first hour, replayed: a fresh clone, the README's install, then every command of the
# ```bash blocks of the README and of the manual pages it links (docs/), in order, each timed. Reports
# each command whose exit status or time differs from what the docs say (a "N minutes" / "N s" claim in
# its comment; over 1.5x the claim counts).
#
#   tools/newcomer.sh [REPO_URL_OR_PATH] [WORKDIR]      # default: this checkout, a new temp dir
#
# Environment: NEWCOMER_CPU_WHEELS=1 installs torch/torchvision from PyTorch's CPU index first (the
# README's CPU route); NEWCOMER_SKIP (a regex, default below) names commands it cannot run here:
# GPUs, several nodes, the network (the hub, uploads), official XL weights. The table goes to
# docs/newcomer-times.md of the checkout it was started from; the run's logs to WORKDIR/logs/.
# Heavy: the README's demos train for minutes each (about an hour on 2 cores).
set -uo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
repo="${1:-$here}"
work="${2:-$(mktemp -d /tmp/newcomer.XXXXXX)}"
skip="${NEWCOMER_SKIP:-torchrun|accelerate launch|sbatch|srun|--push-to-hub|push_to_hub|hf download|hf auth|wget|SiT-XL-2|DiT-XL-2|imagenet|VIRTUAL_imagenet|timm:|hub:|--multi_gpu|/data/|node01|^for |^done|--model (DiT|SiT)-XL/2|<}"
table="$here/docs/newcomer-times.md"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

mkdir -p "$work/logs"
echo "newcomer: cloning $repo into $work/sit-vit5" >&2
git clone -q "$repo" "$work/sit-vit5" || exit 1
cd "$work/sit-vit5" || exit 1
python3 -m venv .venv && . .venv/bin/activate
start=$(date +%s)
if [[ "${NEWCOMER_CPU_WHEELS:-0}" == 1 ]]; then
  pip install -q torch torchvision --index-url https://download.pytorch.org/whl/cpu >"$work/logs/install.log" 2>&1
fi
pip install -q -e ".[dev]" >>"$work/logs/install.log" 2>&1
install_status=$?
install_s=$(( $(date +%s) - start ))

# the README's ```bash blocks, then those of the manual's pages (docs/*.md) in the order the README links
# them, one command per line (backslash continuations joined), in order; the clone and install lines were
# run above
commands="$work/commands.txt"
python3 - README.md >"$commands" <<'EOF'
import re, sys
from pathlib import Path
readme = Path(sys.argv[1])
pages = dict.fromkeys(readme.parent / link for link in re.findall(r"\]\((docs/[^)#\s]+\.md)", readme.read_text()))
manual = [page for page in pages if page.is_file() and "Part of the manual" in page.read_text()]
text = "\n".join(page.read_text() for page in [readme, *manual])
for block in re.findall(r"```bash\n(.*?)```", text, re.S):
    for command in re.sub(r"\\\n\s*", " ", block).splitlines():
        command = command.strip()
        if command and not command.startswith(("#", "git clone", "pip install")):
            print(command)
EOF

# "about 14 minutes", "a few minutes" (= 5), "under 5 minutes", "~19 minutes", "30 s" -> seconds
claim_seconds() {
  python3 - "$1" <<'EOF'
import re, sys
comment = sys.argv[1].partition("#")[2]
m = re.search(r"(\d+(?:\.\d+)?|a few)\s*(?:½\s*)?(minutes?|min|s\b|seconds?)", comment)
if m:
    n = 5.0 if m[1] == "a few" else float(m[1])
    print(int(n * (60 if m[2].startswith("m") else 1)))
EOF
}

{
  echo "# The README, replayed by tools/newcomer.sh"
  echo
  echo "$(date -u +%Y-%m-%d), $(nproc --all) cores, load average $(cut -d' ' -f1-3 /proc/loadavg) at the start;"
  echo "clone of $(git -C "$work/sit-vit5" rev-parse --short HEAD). Install (\`pip install -e \".[dev]\"\`):"
  echo "${install_s} s, exit ${install_status}."
  echo
  echo "| # | command | exit | seconds | README claim (s) | verdict |"
  echo "|---:|---|---:|---:|---:|---|"
} >"$table.tmp"

n=0; differ=0
while IFS= read -r line; do
  n=$((n + 1))
  command="${line%%#*}"
  short="${command:0:90}"
  if [[ "$line" =~ $skip ]]; then
    echo "| $n | \`$short\` | | | | skipped (GPU, network or official weights) |" >>"$table.tmp"
    continue
  fi
  echo "newcomer: [$n] $command" >&2
  t0=$(date +%s)
  bash -c "$command" >"$work/logs/$n.log" 2>&1 </dev/null
  status=$?
  seconds=$(( $(date +%s) - t0 ))
  claim="$(claim_seconds "$line")"
  verdict="as claimed"
  if [[ $status -ne 0 ]]; then
    verdict="FAILED (logs/$n.log: $(tail -n 1 "$work/logs/$n.log" | cut -c1-80))"; differ=$((differ + 1))
  elif [[ -n "$claim" && $seconds -gt $(( claim * 3 / 2 )) ]]; then
    verdict="SLOWER than claimed"; differ=$((differ + 1))
  fi
  echo "| $n | \`$short\` | $status | $seconds | ${claim:-} | $verdict |" >>"$table.tmp"
done <"$commands"

echo >>"$table.tmp"
echo "$differ of $n commands differ from the README." >>"$table.tmp"
mv "$table.tmp" "$table"
cat "$table"
exit $(( differ > 0 ))
