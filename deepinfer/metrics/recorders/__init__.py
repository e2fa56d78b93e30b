"""What each service records: one small class per service shell, its labelled children bound once."""
