"""``python -m recipe.swift``: print the path of the ms-swift plugin file (for ``--external_plugins``)."""

from recipe.swift import plugin_path

if __name__ == "__main__":
    print(plugin_path())
