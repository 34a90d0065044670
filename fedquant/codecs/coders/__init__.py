"""Symbol coders (fixed width, Elias, rANS) and the one body layout every quantizer uses."""
