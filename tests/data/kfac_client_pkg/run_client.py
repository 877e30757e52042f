"""A script that runs the package, as a user's entry point would (not edited for curvax)."""

from kfac_client.train import main

main()
