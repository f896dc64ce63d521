"""Pattern families that rewrite Dynamo FX graphs to fastflow ops, and the pass manager."""
