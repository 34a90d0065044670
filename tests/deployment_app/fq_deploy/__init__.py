"""fedquant deployment test app."""
