# Source this on a GPU machine to import specsplit from this checkout without installing it (those machines have
# no network): a throwaway package folder whose parts link to the checkout's top-level folders.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
site=$(mktemp -d)
mkdir -p "$site/specsplit"
cp "$root"/specsplit/*.py "$site/specsplit/"
for part in proto services kernels operator; do ln -s "$root/$part" "$site/specsplit/$part"; done
export PYTHONPATH="$site:$root/tests${PYTHONPATH:+:$PYTHONPATH}"
