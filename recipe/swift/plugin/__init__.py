"""The file ms-swift imports by path (``--external_plugins``): :data:`PLUGIN_FILE`, alone in this folder because
ms-swift puts the plugin's folder on ``sys.path``."""

from pathlib import Path

PLUGIN_FILE = Path(__file__).resolve().parent / "stalerl_swift_plugin.py"
