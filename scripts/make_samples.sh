#!/usr/bin/env bash
# Regenerates every example file README.md shows, into sample_outputs/.
# Usage: bash scripts/make_samples.sh   (after pip install -e ".[test]")
set -euo pipefail
cd "$(dirname "$0")/.."
out="${ATTNVIZ_SAMPLES_DIR:-sample_outputs}"  # set it to try the script without touching them
mkdir -p "$out"
export HF_HUB_OFFLINE=1 ATTNVIZ_CACHE_DIR="$(mktemp -d)"
trap 'rm -rf "$ATTNVIZ_CACHE_DIR" "$out/.tmp"' EXIT
mkdir -p "$out/.tmp"
S="The cat sat on the mat"

# `readme CMD...` runs a command exactly as README.md prints it (tests/test_rough_edges.py
# checks that README.md holds every such line verbatim), inside $out so that its -o NAME lands
# there; its standard output (the paths it wrote) is discarded.
readme() { (cd "$out" && "$@" >/dev/null); }

# Core: one head, a layer's heads, the model overview, top-k, a dump.
attnviz dump "$S" -o "$out/.tmp/cat" >/dev/null
attnviz heatmap --from "$out/.tmp/cat" --layer 5 --head 3 -o "$out/heatmap_L5_H3.png"
attnviz heatmap --from "$out/.tmp/cat" --layer 0 -o "$out/heatmap_L0_heads.png"
attnviz heatmap --from "$out/.tmp/cat" -o "$out/overview.png"
attnviz heatmap --from "$out/.tmp/cat" --layer 2 --head mean --exclude-special \
  -o "$out/heatmap_L2_mean_no_special.png"
attnviz top-k --from "$out/.tmp/cat" --layer 5 --head 3 -f markdown -o "$out/topk_L5_H3.md"
readme attnviz heatmap "The bank of the river" --pair "The bank approved the loan" --layer 3 --head 7 -o heatmap_pair.png

# Figures at real lengths: a window of a paragraph, and the colour scales on one head.
attnviz dump "When the old lighthouse keeper retired, the village council argued for months about whether to automate the lamp, sell the building to a hotel chain, or turn it into a museum; in the end the children of the school voted, and the museum won by a single vote." -o "$out/paragraph" >/dev/null
readme attnviz heatmap --from paragraph --layer 2 --head 3 --tokens 15:45 -o heatmap_zoom.png
rm -r "$out/paragraph"
readme attnviz heatmap "The cat sat on the mat because it was warm." --layer 4 --head 1 --scale linear --vmax 1 -o scale_linear.png
readme attnviz heatmap "The cat sat on the mat because it was warm." --layer 4 --head 1 -o scale_default.png
readme attnviz heatmap "The cat sat on the mat because it was warm." --layer 4 --head 1 --scale log -o scale_log.png

# Toy model: bidirectional vs causal, and softmax saturation without 1/sqrt(d_k).
T="the robot picked up the red ball"
attnviz heatmap "$T" --model toy --toy-heads 2 --d-model 16 --layer 0 --head 0 \
  -o "$out/toy_bidirectional.png"
attnviz heatmap "$T" --model toy --toy-heads 2 --d-model 16 --layer 0 --head 0 --causal \
  -o "$out/toy_causal.png"
attnviz heatmap "$T" --model toy --toy-heads 1 --d-model 64 --layer 0 --head 0 --no-scale \
  -o "$out/toy_no_scale.png"

# Batch export: one head figure from the fast renderer.
attnviz export "$S" "A dog barked at the moon" --layers 1 --jobs 1 -o "$out/.tmp/export" >/dev/null
cp "$out/.tmp/export/"a-dog-barked*/heads/L01_H08.png "$out/export_head_L1_H8.png"

# Head analysis: statistics plot and table, rollout, compare, explain.
W="The cat sat on the mat because it was warm."
readme attnviz heads "The cat sat on the mat because it was warm." --plot heads_entropy.png --stat entropy
attnviz heads "$W" --format markdown -o "$out/heads.md" >/dev/null
readme attnviz rollout "The cat sat on the mat because it was warm." --token it -o rollout.png
rm "$out/rollout.npy"  # it also wrote rollout_bar_it.png; README shows the two pictures
attnviz compare "$T" --model toy --vs-causal --head 0 -o "$out/compare_toy_causal.png" \
  --format markdown > "$out/compare_toy_causal.md"
readme attnviz compare "The cat sat on the mat" "The dog sat on the mat" --layer 2 -o compare_cat_dog.png
attnviz compare "The bank of the river" "The bank approved the loan" --words --layer 2 \
  --head mean -o "$out/compare_bank.png" > /dev/null 2>&1
attnviz explain "The cat sat on the mat" --token cat --format json > "$out/.tmp/explain.json"
COLUMNS=100 attnviz explain "The cat sat on the mat" --token cat > "$out/explain_cat.txt"

# Long inputs: the atlas of one head of a tiny random-weight Llama (GQA) over 8,000 tokens.
python scripts/tiny_llama.py "$out/.tmp/llama" && (cd "$out/.tmp" && attnviz heatmap - --model llama --long --layer 1 --head 0 -o ../long_atlas.png < llama/text.txt >/dev/null)

# Interactive HTML report and the inline notebook views: screenshots (need Chromium; skipped
# without it).
attnviz html "$W" -o "$out/.tmp/report.html" >/dev/null
if command -v chromium >/dev/null 2>&1; then
  python scripts/screenshot_report.py --sample "$out/html_report.png"
  python scripts/screenshot_notebook.py "$out/notebook_views.png"
  python scripts/screenshot_serve.py "$out/serve_live.png"  # the page of attnviz serve
fi
ls -la "$out"
