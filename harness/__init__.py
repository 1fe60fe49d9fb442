"""The harness: everything LoadGen touches, and the system it brings up (router process, Ray workers).

Importing it, before Ray is imported, keeps the Ray this process starts on loopback (harness/ray_network.py)."""

from harness.ray_network import keep_ray_on_loopback

keep_ray_on_loopback()
