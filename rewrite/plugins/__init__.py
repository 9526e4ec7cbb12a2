"""Built-in plugins, one module each, and the plugin base class and manager."""
