"""First-party moe plugins (backends arrive with their own issues)."""

LMPLUG_API_VERSION = 1
