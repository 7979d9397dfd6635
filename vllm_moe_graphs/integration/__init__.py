"""The thin integration layer: everything that imports vLLM internals lives here.

A port to a newer vLLM changes only this package. `patch/` holds one file per patched vLLM
symbol; `signatures.py` checks, at registration, that the private APIs we touch still look the
way this code expects, and fails with a clear message otherwise.
"""
