"""Configuration: each setting declared once (settings.py), the settings of `kvfence serve`
(config.py) and of the other commands (command_options.py), read from defaults, the --config TOML
file, KVFENCE_* variables (environment.py, the one place that reads them) and flags."""
