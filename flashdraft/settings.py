"""(placeholder until the settings module lands: reads the flags where they live today)"""

import flashdraft.config as _config


def __getattr__(name):
    return getattr(_config, name)
