"""Training: train.py's flags and recipe, augmentation, the loop, evaluation, checkpoints and the run directory,
stopping, several processes, trackers, the Hub-format model directory. May import data/, translation/ and the
package root; nothing outside training/ imports it."""
