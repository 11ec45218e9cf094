# Source this on a GPU machine to import specsplit from this checkout without installing it (those machines have
# no network): a throwaway package folder whose parts link to the checkout's top-level folders.
# Then run from outside the checkout (cd /tmp; python3 "$R"/bench/...): a child started with `python -m` (a tensor
# parallel rank, a spawned service) puts its working directory first on sys.path, and the checkout's own specsplit/
# folder (the CLI alone) would shadow this package there.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
site=$(mktemp -d)
mkdir -p "$site/specsplit"
cp -r "$root"/specsplit/. "$site/specsplit/"
for part in proto services kernels operator; do ln -s "$root/$part" "$site/specsplit/$part"; done
export PYTHONPATH="$site:$root/tests${PYTHONPATH:+:$PYTHONPATH}"
