"""Fetch one release's sdist from the package index with pip's own machinery, into a cache; print its path.

Usage: python fetch_sdist.py NAME VERSION CACHE_DIR

`pip download --no-binary :all: vllm==X` builds the sdist's metadata (vLLM's setup.py wants CUDA and torch), so
it fails before the download is done; the sdist only has to be found and fetched. pip's PackageFinder and
PipSession do that with pip's configuration (index URL, certificate bundle, proxy, timeout), and the file is
checked against the hash the index gives for it. A cached file whose hash still matches is not fetched again.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from pip._internal.configuration import Configuration
from pip._internal.index.collector import LinkCollector
from pip._internal.index.package_finder import PackageFinder
from pip._internal.models.search_scope import SearchScope
from pip._internal.models.selection_prefs import SelectionPreferences
from pip._internal.network.session import PipSession


def _pip_setting(config: Configuration, key: str) -> str | None:
    env = os.environ.get("PIP_" + key.split(".", 1)[1].upper().replace("-", "_"))
    if env:
        return env
    try:
        return config.get_value(key)
    except Exception:  # not set
        return None


def _digest(path: Path, name: str) -> str:
    h = hashlib.new(name)
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist(name: str, version: str, cache: Path) -> Path:
    config = Configuration(isolated=False)
    config.load()
    session = PipSession(retries=3)
    session.timeout = float(_pip_setting(config, "global.timeout") or _pip_setting(config, "global.default-timeout")
                            or 60)
    cert = _pip_setting(config, "global.cert")
    if cert:
        session.verify = cert
    index = _pip_setting(config, "global.index-url") or "https://pypi.org/simple"
    finder = PackageFinder.create(
        link_collector=LinkCollector(session=session, search_scope=SearchScope.create(
            find_links=[], index_urls=[index], no_index=False)),
        selection_prefs=SelectionPreferences(allow_yanked=False))
    sdists = [c.link for c in finder.find_all_candidates(name)
              if str(c.version) == version and not c.link.is_wheel and c.link.filename.endswith(".tar.gz")]
    if not sdists:
        sys.exit(f"fetch_sdist: no sdist of {name}=={version} on {index}")
    link = sdists[0]
    target = cache / link.filename
    if target.exists() and link.hash_name and _digest(target, link.hash_name) == link.hash:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(target.suffix + ".part")
    with session.get(link.url_without_fragment, stream=True, timeout=session.timeout) as response:
        response.raise_for_status()
        with partial.open("wb") as out:
            for chunk in response.iter_content(1 << 20):
                out.write(chunk)
    if link.hash_name and _digest(partial, link.hash_name) != link.hash:
        partial.unlink()
        sys.exit(f"fetch_sdist: {link.filename}: {link.hash_name} does not match the index's")
    partial.replace(target)
    return target


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: fetch_sdist.py NAME VERSION CACHE_DIR")
    print(fetch_sdist(sys.argv[1], sys.argv[2], Path(sys.argv[3])))
