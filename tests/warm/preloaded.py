"""Imported only by :func:`tests.warm.probe.preload`: in a fork's ``sys.modules`` it shows the preload ran there."""
